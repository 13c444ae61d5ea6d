"""foreign_kernels_owners: other installed distributions that also ship a top-level `kernels`.

Hugging Face's `kernels` wheel (pulled in by some transformers extras) installs a top-level
package named `kernels`, as this project does. pip does not refuse the second install: it writes
both into one `site-packages/kernels/` folder, whichever `__init__.py` came last wins, and
uninstalling either one deletes files the other needs. kvengine checks at start and refuses with
one line rather than fail later on a mix of two packages.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import distributions

OUR_DISTRIBUTION = "kvstore-tiered"


def _ships_kernels(dist) -> bool:
    """Whether ``dist`` installs a top-level ``kernels``: its top_level.txt, else its RECORD
    searched as text (parsing every file entry of a large environment costs half a second of
    the engine's start; a substring search costs milliseconds)."""
    text = dist.read_text("top_level.txt")
    if text:
        return "kernels" in {line.strip() for line in text.splitlines()}
    record = dist.read_text("RECORD") or ""
    return record.startswith("kernels/") or "\nkernels/" in record


def foreign_kernels_owners(path: list[str] | None = None) -> list[str]:
    """Names of installed distributions other than ours with a top-level `kernels` package
    (searching `path`, default sys.path). Only the folders that hold a `kernels` package are
    searched: a distribution that installs one puts it beside its own metadata, and an image
    with hundreds of distributions (torch, JAX, ...) elsewhere costs nothing."""
    roots = [entry for entry in (sys.path if path is None else path)
             if os.path.isdir(os.path.join(entry or os.curdir, "kernels"))]
    owners = set()
    for dist in distributions(path=roots):
        if not _ships_kernels(dist):
            continue
        name = dist.metadata["Name"] or ""
        if name.lower().replace("_", "-") != OUR_DISTRIBUTION:
            owners.add(name)
    return sorted(owners)


def kernels_conflict_message(owners: list[str]) -> str:
    """The one-line refusal for `owners` (non-empty)."""
    return (f"the installed distribution(s) {', '.join(owners)} also provide a top-level "
            "`kernels` package, which pip merges with kvengine's own `kernels` in one folder: "
            f"run `pip uninstall {' '.join(owners)}`, then `pip install --force-reinstall "
            f"--no-deps {OUR_DISTRIBUTION}` (or use a separate virtualenv)")
