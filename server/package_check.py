"""foreign_kernels_owners: other installed distributions that also ship a top-level `kernels`.

Hugging Face's `kernels` wheel (pulled in by some transformers extras) installs a top-level
package named `kernels`, as this project does. pip does not refuse the second install: it writes
both into one `site-packages/kernels/` folder, whichever `__init__.py` came last wins, and
uninstalling either one deletes files the other needs. kvengine checks at start and refuses with
one line rather than fail later on a mix of two packages.
"""

from __future__ import annotations

from importlib.metadata import distributions

OUR_DISTRIBUTION = "kvstore-tiered"


def _top_level_names(dist) -> set[str]:
    text = dist.read_text("top_level.txt")
    if text:
        return {line.strip() for line in text.splitlines() if line.strip()}
    return {str(f).split("/", 1)[0] for f in (dist.files or ()) if "/" in str(f)}


def foreign_kernels_owners(path: list[str] | None = None) -> list[str]:
    """Names of installed distributions other than ours with a top-level `kernels` package
    (searching `path`, default sys.path)."""
    owners = set()
    for dist in distributions(**({} if path is None else {"path": path})):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name != OUR_DISTRIBUTION and "kernels" in _top_level_names(dist):
            owners.add(dist.metadata["Name"])
    return sorted(owners)


def kernels_conflict_message(owners: list[str]) -> str:
    """The one-line refusal for `owners` (non-empty)."""
    return (f"the installed distribution(s) {', '.join(owners)} also provide a top-level "
            "`kernels` package, which pip merges with kvengine's own `kernels` in one folder: "
            f"run `pip uninstall {' '.join(owners)}`, then `pip install --force-reinstall "
            f"--no-deps {OUR_DISTRIBUTION}` (or use a separate virtualenv)")
