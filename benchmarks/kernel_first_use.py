"""First use of our attention kernels with a cold CuPy cache, with and without the warm-up.

Our kernels serve every prefill shape cuDNN has no graph for yet (``kernels/cudnn_plans.py``),
and NVRTC compiles each of their modules on first use. Each mode runs in a fresh process with an
empty ``CUPY_CACHE_DIR`` (a fresh machine): ``cold`` calls ``paged_attention_prefill`` at once;
``warmed`` runs ``kernels.kernel_warm_up.warm_kernels`` first (what the engine does before
ready), timed. Per case: the first call's wall time, the median of the next three, and one call
per layer (a whole step's attention). Shapes: multi-sequence prefills over an 8k-token table at
the Qwen3-4B head shape, the kind of step that met an uncovered cuDNN key on an H200.

    python -m benchmarks.kernel_first_use [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import command, machine_info, now_iso, today, write_result

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, BLOCKS = 32, 8, 128, 16, 36, 4096
CASES = {"3 sequences, short queries": [300, 30, 30],
         "8 sequences": [1024, 200, 100, 100, 100, 100, 100, 100]}
CONTEXT = 8192


def _child(mode: str) -> dict:
    import cupy as cp
    import numpy as np

    from kernels import attention
    from kernels.cuda_module import BF16
    from kernels.kernel_warm_up import warm_kernels

    def synced_ms(fn) -> float:
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        return (time.perf_counter() - start) * 1e3

    kv = cp.zeros((BLOCKS, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM), dtype=BF16)
    out: dict = {"mode": mode}
    if mode == "warmed":
        out["warm_kernels_ms"] = synced_ms(
            lambda: warm_kernels(HEADS, KV_HEADS, HEAD_DIM, BLOCK, 151936))
    rng = np.random.default_rng(0)
    for name, q_lens in CASES.items():
        q = cp.asarray(rng.standard_normal((sum(q_lens), HEADS, HEAD_DIM)), dtype=cp.float32)
        q = q.astype(BF16)
        tables = cp.asarray(rng.integers(0, BLOCKS, (len(q_lens), CONTEXT // BLOCK)), cp.int32)
        cu = cp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), dtype=cp.int32)
        lens = cp.full(len(q_lens), CONTEXT, dtype=cp.int32)

        def one(layer: int = 0, q=q, tables=tables, cu=cu, lens=lens):
            attention.paged_attention_prefill(q, kv, layer, tables, cu, lens, HEAD_DIM ** -0.5)

        first = synced_ms(one)
        again = sorted(synced_ms(one) for _ in range(3))[1]
        step = synced_ms(lambda: [one(layer) for layer in range(LAYERS)])
        out[name] = {"q_lens": q_lens, "first_call_ms": round(first, 2),
                     "next_call_ms": round(again, 3), "all_layers_ms": round(step, 2)}
    return out


def run_mode(mode: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CUPY_CACHE_DIR=cache)
        done = subprocess.run([sys.executable, "-m", "benchmarks.kernel_first_use", "--child",
                               mode], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{mode} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--child", choices=("cold", "warmed"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child)))
        return 0
    modes = {mode: run_mode(mode) for mode in ("cold", "warmed")}
    result = {"benchmark": "kernel_first_use", "machine": machine_info(), "date": now_iso(),
              "command": command("python -m benchmarks.kernel_first_use", argv),
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                        "layers": LAYERS, "context": CONTEXT},
              "modes": modes,
              "ratios": {name: {mode: round(modes[mode][name]["first_call_ms"]
                                            / modes[mode][name]["next_call_ms"], 1)
                                for mode in modes} for name in CASES}}
    print(json.dumps(result, indent=2))
    write_result(args.out, f"kernel-first-use-{today()}.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
