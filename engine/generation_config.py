"""The sampling defaults a checkpoint's ``generation_config.json`` sets, read as vLLM reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# vLLM (`--generation-config auto`, its default) takes these when the file sets them and ignores
# `do_sample`: Qwen3's temperature 0.6, top_p 0.95, top_k 20 apply to every request that leaves
# them out. `max_new_tokens` becomes the default `max_tokens`.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG_FILE = "generation_config.json"


def sampling_defaults(folder: str | Path) -> dict[str, Any]:
    """``{field: value}`` for the sampling fields ``folder/generation_config.json`` sets
    (``max_new_tokens`` as ``max_tokens``); empty without the file. ValueError for a file that
    is not a JSON object or a value that is not a number."""
    path = Path(folder) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    defaults: dict[str, Any] = {}
    for key in (*SAMPLING_KEYS, "max_new_tokens"):
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
        defaults["max_tokens" if key == "max_new_tokens" else key] = value
    if "top_k" in defaults:
        defaults["top_k"] = int(defaults["top_k"])
    return defaults
