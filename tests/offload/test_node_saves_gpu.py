"""GPU, two devices, at the scale where a node's saves failed: one daemon with a DRAM pool past
64 GiB (pinned in many chunks), an engine on ``cuda:0`` and one on ``cuda:1``, each computing
19k-token prompts (Qwen3-0.6B shape, 2.2 GB of KV each) and saving them write-through at the
same time for a minute (``KVSTORE_NODE_SOAK_S``), so the pool fills, evicts and wraps across its
chunk boundaries under two writers. Then each engine loads the other's latest prompts.

Zero failed saves and loads on both engines and in the daemon, and every loaded block equal to
what the other engine computed: each engine keeps two 64-bit sums per block of what it computed
(the words, and the words weighted by position, on its GPU), and the loader compares the sums of
what it restored. Skipped without two GPUs or without the host memory for the pool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from daemon_helpers import REPO_ROOT, start_daemon
from support.gpus import num_cuda_devices

from engine.make_model import write_checkpoint
from kvstore.store.dram.host_memory import available_bytes

pytestmark = pytest.mark.gpu

GiB = 1 << 30
POOL_BYTES = 80 * GiB
PROMPT_TOKENS = 19_008
NUM_CHECKED = 4  # the other engine's latest prompts, loaded back

_ENGINE = textwrap.dedent("""
    import json, os, sys, time
    import cupy as cp
    import numpy as np
    from engine import LLM, SamplingParams
    from kvstore.keys import block_hashes

    role, other, device, seconds = {role!r}, {other!r}, {device!r}, {seconds!r}
    out_dir = {out_dir!r}
    llm = LLM({model!r}, device=device, kv_offload=True, kv_store_socket={socket!r},
              num_kv_blocks=2600, max_model_len=20480, kv_offload_restore="always")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine = llm.engine

    def prompt_of(owner, i):
        seed = (0 if owner == "a" else 1_000_000) + i
        return np.random.default_rng(seed).integers(10, 1000, {tokens}).tolist()

    def sums(prompt, num_blocks):
        if num_blocks == 0:
            return []
        bm = engine.block_manager
        keys = block_hashes(engine.namespace("").digest, prompt, 16)[:num_blocks]
        rows = cp.asarray([bm._by_key[k] for k in keys])
        words = engine.kv_cache.array[rows].view(cp.uint32).reshape(len(keys), -1)
        words = words.astype(cp.uint64)
        weights = cp.arange(1, words.shape[1] + 1, dtype=cp.uint64)
        return [[int(a), int(b)] for a, b in zip(cp.asnumpy(words.sum(axis=1)),
                                                 cp.asnumpy((words * weights).sum(axis=1)))]

    computed = {{}}
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        i = len(computed)
        prompt = prompt_of(role, i)
        engine_out = llm.generate([prompt], params)[0]
        assert engine_out.num_cached_tokens == 0, engine_out.cached_tokens_by_tier
        computed[i] = sums(prompt, len(prompt) // 16)
    engine.offload.wait_idle(120.0)
    stats = engine.offload.stats()
    with open(os.path.join(out_dir, role + ".json.tmp"), "w") as f:
        json.dump({{"computed": computed, "offload": stats}}, f, default=str)
    os.rename(os.path.join(out_dir, role + ".json.tmp"), os.path.join(out_dir, role + ".json"))

    theirs = os.path.join(out_dir, other + ".json")
    deadline = time.monotonic() + 600
    while not os.path.exists(theirs):
        assert time.monotonic() < deadline, "the other engine never finished"
        time.sleep(0.2)
    their_sums = json.load(open(theirs))["computed"]
    latest = sorted(int(k) for k in their_sums)[-{checked}:]
    # where a block that differs came from, if it is another of their blocks: [prompt, block]
    where = {{tuple(v): [int(k), j] for k, blocks in their_sums.items()
             for j, v in enumerate(blocks)}}
    checks = []
    for i in latest:
        prompt = prompt_of(other, i)
        got = llm.generate([prompt], params)[0]
        restored = got.num_cached_tokens // 16
        mine = sums(prompt, restored)
        differ = [j for j, (x, y) in enumerate(zip(mine, their_sums[str(i)])) if x != y]
        checks.append({{"prompt": i, "restored_blocks": restored,
                        "by_tier": got.cached_tokens_by_tier,
                        "store_state": engine.offload.stats().get("store_state"),
                        "equal": mine == their_sums[str(i)][:restored],
                        "differ": len(differ), "first_differ": differ[:8],
                        "found_as": [where.get(tuple(mine[j])) for j in differ[:8]]}})
    print("RESULT " + json.dumps({{"role": role, "computed": len(computed), "checks": checks,
                                  "offload": engine.offload.stats()}}, default=str), flush=True)
    llm.close()
""")


def _stall_stacks(stats: dict) -> list[str]:
    """The stacks the daemon wrote while its loop stalled (its ``stack_file``), if any."""
    path = stats["daemon"]["stalls"].get("stack_file")
    if not path or not Path(path).exists():
        return []
    return Path(path).read_text().splitlines()[:200]


def _pool_fits() -> bool:
    available = available_bytes()
    return available is not None and available[0] > POOL_BYTES + 24 * GiB


@pytest.mark.skipif(num_cuda_devices() < 2, reason="needs two GPUs")
@pytest.mark.skipif(not _pool_fits(), reason="needs 104 GiB of free host memory")
def test_two_engines_save_19k_prompts_for_a_minute_then_load_each_others(tmp_path: Path) -> None:
    seconds = float(os.environ.get("KVSTORE_NODE_SOAK_S", "60"))
    model = tmp_path / "model"
    write_checkpoint(model, "qwen3-0.6b", seed=0)
    daemon = start_daemon(tmp_path, dram=f"{POOL_BYTES // GiB}GiB", http=False,
                          start_timeout_s=120.0,  # a stall's stacks, for the report
                          env={"KVSTORE_DEBUG_STALL_STACKS": "1"})
    children = {}
    try:
        for role, other, device in (("a", "b", "cuda:0"), ("b", "a", "cuda:1")):
            script = _ENGINE.format(role=role, other=other, device=device, seconds=seconds,
                                    out_dir=str(tmp_path), model=str(model),
                                    socket=str(daemon.socket_path), tokens=PROMPT_TOKENS,
                                    checked=NUM_CHECKED)
            children[role] = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True)
        results, warnings = {}, {}
        for role, child in children.items():
            stdout, stderr = child.communicate(timeout=seconds + 900)
            assert child.returncode == 0, stderr[-4000:]
            warnings[role] = [x for x in stderr.splitlines() if "WARNING" in x][:20]
            line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
            results[role] = json.loads(line[len("RESULT "):])
        with daemon.client() as c:
            stats = c.stats()
        events = stats["daemon"]["events"]
        # what a late reply would come from (loop lateness, collector pauses), the HBM tier's
        # copies from the other engine's arena, and the engines' results
        print(json.dumps({"daemon_events": events, "stalls": stats["daemon"]["stalls"],
                          "hbm_tier": stats["tiers"].get("hbm"), "engines": results,
                          "warnings": {"daemon": [x for x in daemon.lines
                                                  if "WARNING" in x][:20], **warnings},
                          # what the daemon's threads ran while its loop stalled
                          "stall_stacks": _stall_stacks(stats)},
                         default=str))
        assert events.get("blocks_save_failed", 0) == 0, events
        errors = [line for line in daemon.lines if " ERROR " in line or " CRITICAL " in line]
        assert not errors, errors[:5]
        for role, result in results.items():
            offload = result["offload"]
            assert offload.get("blocks_save_failed", 0) == 0, (role, offload)
            assert offload.get("load_errors", 0) == 0, (role, offload)
            assert offload.get("restores_short", 0) == 0, (role, offload)
            assert result["computed"] >= 2 * NUM_CHECKED, (role, result["computed"])
            for check in result["checks"]:
                # the other's latest prompts: all but the last (partial) block restored
                assert check["restored_blocks"] == PROMPT_TOKENS // 16 - 1, (role, check)
                assert check["equal"], (role, check)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait(10)
        daemon.stop()
