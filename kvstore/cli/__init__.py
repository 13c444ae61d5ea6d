"""The ``kvstore`` command (``kvstore.cli:main``, ``python -m kvstore.cli``): ``command.py`` parses
and dispatches, ``serve.py`` starts the daemon, ``stats.py`` reads a running one; ``args.py`` is
the argparse vocabulary ``kvengine``'s CLI shares."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # ``main`` loads the daemon's parts: importing ``kvstore.cli.args`` (as kvengine does) must not.
    if name == "main":
        from kvstore.cli.command import main

        return main
    raise AttributeError(name)
