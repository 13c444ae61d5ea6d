"""``python -m kvstore.cli``: the ``kvstore`` command."""

import sys

from kvstore.cli.command import main

if __name__ == "__main__":  # importing the module (a walk over every module) runs nothing
    sys.exit(main())
