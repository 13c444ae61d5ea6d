"""Isolation through real engines and a real daemon: the store shares a prefix only between
engines of the same model identity and tenant (paired: the same tenant does share)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.make_model import write_checkpoint
from engine.weights import read_header, weights_identity

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
NUM_FULL_BLOCKS = 8


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny checkpoints that differ only in their weights."""
    root = tmp_path_factory.mktemp("isolation-models")
    write_checkpoint(root / "a", "tiny", seed=0)
    write_checkpoint(root / "b", "tiny", seed=1)
    return root / "a", root / "b"


def _run(model_dir: Path, daemon, prompt: list[int], salt: str = "", **kwargs) -> dict:
    """A fresh engine (empty HBM: only the store can serve a prefix) runs ``prompt`` once."""
    llm = LLM(str(model_dir), device="cpu", kv_offload=True, num_kv_blocks=64,
              kv_store_socket=str(daemon.socket_path), kv_offload_restore="always", **kwargs)
    try:
        out = llm.generate([prompt], GREEDY, cache_salt=salt)[0]
        llm.engine.offload.wait_idle()  # its blocks are saved (write-through) before it goes
        return out.cached_tokens_by_tier
    finally:
        llm.close()


def test_tenants_and_model_identities_share_only_with_themselves(make_daemon, model_dirs):
    model_a, model_b = model_dirs
    daemon = make_daemon(dram="64MiB")
    prompt = np.random.default_rng(4).integers(10, 1000, 16 * NUM_FULL_BLOCKS + 3).tolist()
    full = 16 * NUM_FULL_BLOCKS
    assert _run(model_a, daemon, prompt, salt="tenant-a")["dram"] == 0  # computed and saved
    # Another tenant, no tenant, other weights, another block size: nothing from the store.
    assert _run(model_a, daemon, prompt, salt="tenant-b")["dram"] == 0
    assert _run(model_a, daemon, prompt)["dram"] == 0
    assert _run(model_b, daemon, prompt, salt="tenant-a")["dram"] == 0
    assert _run(model_a, daemon, prompt, salt="tenant-a", block_size=8)["dram"] == 0
    # Paired: the same tenant on the same model shares the whole prefix, and so does every
    # identity above now that it has saved its own blocks.
    assert _run(model_a, daemon, prompt, salt="tenant-a")["dram"] == full
    assert _run(model_a, daemon, prompt, salt="tenant-b")["dram"] == full
    assert _run(model_b, daemon, prompt, salt="tenant-a")["dram"] == full
    with daemon.client() as c:
        stats = c.stats()
    # Five identities saved the prompt's blocks once each (the 8-token blocks are twice as many).
    assert stats["counters"]["puts"] == 4 * NUM_FULL_BLOCKS + 2 * NUM_FULL_BLOCKS


def test_weights_identity_sees_weight_values_not_only_names_and_sizes(model_dirs, tmp_path):
    # A fine-tune saved over the same config, names and shapes: same sizes, other values.
    model_a, _ = model_dirs
    tuned = tmp_path / "tuned"
    shutil.copytree(model_a, tuned)
    assert weights_identity(tuned) == weights_identity(model_a)
    path = sorted(tuned.glob("*.safetensors"))[0]
    info = max(read_header(path), key=lambda i: i.end - i.start)  # a large tensor
    for offset in (info.start, (info.start + info.end) // 2, info.end - 1):
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))
        assert weights_identity(tuned) != weights_identity(model_a), offset
        with open(path, "r+b") as f:  # put it back: the same bytes are the same identity
            f.seek(offset)
            f.write(byte)
        assert weights_identity(tuned) == weights_identity(model_a)
