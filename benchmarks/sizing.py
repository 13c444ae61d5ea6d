"""How big a multi-turn run's pools are: the model's KV block bytes and context length, its tokens
per word, and from the workload's estimated working set the HBM pool of each regime, the daemon's
DRAM and ``max_model_len``. The sweep, the presets, the node and the fault soak all size this way.

Regimes: ``fits`` holds every user's whole conversation in the HBM pool; ``pressure`` makes the
pool ``pressure_factor`` times smaller than the users' total context (but holds the longest
prompt), with the daemon's DRAM holding all of it.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

from benchmarks.workload import WorkloadConfig, words_text

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def model_shape(model_dir: Path, block_size: int) -> tuple[int, int]:
    """(bytes of one KV block, max_position_embeddings) from config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    block_bytes = (2 * cfg["num_hidden_layers"] * kv_heads * head_dim * block_size
                   * _DTYPE_BYTES.get(str(dtype), 2))
    return block_bytes, int(cfg.get("max_position_embeddings") or 32768)


def tokens_per_word_of(model_dir: Path, seed: int) -> float | None:
    """Tokens per generated word with the model's own tokenizer (None without tokenizer.json)."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    text = words_text(random.Random(f"calibrate:{seed}"), 4000, 1.0)
    num_tokens = len(Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids)
    return num_tokens / len(text.split())


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def plan_sizing(workload: WorkloadConfig, block_bytes: int, max_positions: int, *,
                block_size: int, pressure_factor: float, max_model_len: int | None = None,
                fits_kv_blocks: int | None = None, pressure_kv_blocks: int | None = None,
                dram_bytes: int | None = None) -> dict:
    """HBM pool per regime, DRAM and max_model_len from the workload's estimated working set;
    a size given (not None) is taken as it is."""
    bs = block_size
    last = workload.last_prompt_len() + workload.answer_len
    max_model_len = max_model_len or min(max_positions, -(-int(last * 1.3 + 64) // bs) * bs)
    ctx_blocks = -(-max_model_len // bs)
    ws_tokens = workload.working_set_tokens()
    ws_blocks = -(-int(ws_tokens * 1.15) // bs)  # text lengths are approximate: a margin
    fits = fits_kv_blocks or max(int(ws_blocks * 1.5), 2 * ctx_blocks) + 16
    pressure = pressure_kv_blocks or max(math.ceil(ws_blocks / pressure_factor), ctx_blocks + 16)
    dram = dram_bytes or 2 * ws_blocks * block_bytes + 64 * 2**20
    host = _host_memory_bytes()
    if not dram_bytes and host:
        dram = min(dram, int(host * 0.6))
    notes = []
    if ws_blocks / pressure < 2:
        notes.append(f"pressure regime: working set only {ws_blocks / pressure:.1f}x the HBM "
                     "pool (raise --users or --history-len, or lower --pressure-kv-blocks)")
    if ws_blocks * block_bytes > dram:
        notes.append("the working set does not fit the daemon's DRAM: SSD or misses will count")
    if fits < ws_blocks:
        notes.append("fits regime: the HBM pool is smaller than the working set")
    return {"block_size": bs, "block_bytes": block_bytes, "max_model_len": max_model_len,
            "working_set_tokens_est": ws_tokens, "working_set_blocks_est": ws_blocks,
            "working_set_bytes_est": ws_blocks * block_bytes, "dram_bytes": int(dram),
            "regimes": {
                "fits": {"num_kv_blocks": fits, "working_set_over_hbm": ws_blocks / fits},
                "pressure": {"num_kv_blocks": pressure,
                             "working_set_over_hbm": ws_blocks / pressure}},
            "notes": notes}
