"""resolve_model: what `kvengine serve MODEL` names, as a local folder: a folder, or a hub id.

A hub id (`Qwen/Qwen3-0.6B`) is looked up in the Hugging Face cache first, without the network:
a snapshot already there serves offline. Only when it is missing and the hub is not switched off
(`HF_HUB_OFFLINE=1`) is it downloaded, limited to the files the engine reads. The engine itself
never touches the network; this runs in the CLI before the engine starts.
"""

from __future__ import annotations

import re
from pathlib import Path

# What the engine reads from a checkpoint; a hub repo often also holds other formats (.bin,
# .gguf, original/ consolidated weights) that would multiply the download.
MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelNotFound(Exception):
    """MODEL is neither a folder nor a hub id that could be found; the message is one line."""


def looks_like_hub_id(name: str) -> bool:
    """`org/name` or `name` with the characters the hub allows, and not a path."""
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "/")) and ".." not in name


def resolve_model(name: str, revision: str | None = None) -> Path:
    """The local folder of `name`: the folder itself when it is one, else the hub snapshot of the
    repo id `name` (at `revision`, default: main). ModelNotFound says why not in one line."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFound(f"{name} is a file, not a model folder")
    if not looks_like_hub_id(name):
        raise ModelNotFound(f"{name}: no such directory (and not a Hugging Face repo id)")
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ModelNotFound(f"{name}: no such folder, and huggingface_hub is not installed to "
                            "look it up as a hub id (pip install huggingface_hub)") from None
    cache = constants.HF_HUB_CACHE
    try:
        return Path(snapshot_download(name, revision=revision, local_files_only=True,
                                      allow_patterns=list(MODEL_FILE_PATTERNS)))
    except LocalEntryNotFoundError:
        pass
    except Exception as exc:  # a malformed id or a damaged cache entry: one line, not a trace
        raise ModelNotFound(f"{name}: cannot read the Hugging Face cache at {cache}: "
                            f"{exc}") from None
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFound(f"{name} is not a local folder and not in the Hugging Face cache at "
                            f"{cache}; HF_HUB_OFFLINE is set, so it is not downloaded (download "
                            f"it once with the hub on, or pass a model folder)")
    try:
        return Path(snapshot_download(name, revision=revision,
                                      allow_patterns=list(MODEL_FILE_PATTERNS)))
    except Exception as exc:  # the hub's errors (no network, 401, 404) are many types
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFound(f"{name} is not a local folder, not in the Hugging Face cache at "
                            f"{cache}, and the download failed: {first_line} (set "
                            f"HF_HUB_OFFLINE=1 to use the cache only)") from None
