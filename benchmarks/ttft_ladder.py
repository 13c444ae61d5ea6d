"""The TTFT ladder: time to first token per context length when the prefix is cold, in HBM, in the
store's DRAM, on its SSD, next to HF transformers' cold prefill of the same weights, in one run.

A real `kvstore serve` runs beside one engine with --kv-offload. For each context length: a fresh
random prompt is prefilled cold (and saved write-through), then asked again (HBM hit), then again
after ``reset_prefix_cache`` (DRAM restore). After every length is in, the daemon restarts (SIGTERM
flushes DRAM to SSD; the new daemon's DRAM is empty) and each prompt is asked once more (SSD
restore). Restores are forced (``kv_offload_restore="always"``) so every rung is measured; the
cost model's own choice per rung is recorded beside it. The target at 16k: DRAM restore <=
1.25 x (KV bytes / raw H2D bandwidth) + HBM-hit TTFT, with raw H2D measured in the same run.
Writes JSON (+ a PNG when matplotlib is there).

    python -m benchmarks.ttft_ladder --preset qwen3-4b --device cuda --lengths 256,1024,4096,16384
    python -m benchmarks.ttft_ladder --preset tiny --device cpu --lengths 256,1024   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import command, machine_info, now_iso, raw_h2d_gbps, today, write_result
from benchmarks.engine import model_dir_for
from server.demo import start_embedded_daemon


def ttft(engine, prompt: list[int], tag: str) -> tuple[float, dict]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(tag, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == tag and out.finished:
                return time.perf_counter() - started, dict(out.cached_tokens_by_tier)


def _hf_prefill_ms(model_dir: Path, lengths: list[int], vocab: int, device: str) -> dict:
    try:
        import torch
        import transformers
    except ImportError:
        return {}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.to("cuda" if device == "cuda" else "cpu")
    model.eval()
    out = {}
    rng = np.random.default_rng(1)
    with torch.inference_mode():
        for n in lengths:
            ids = torch.tensor(rng.integers(10, vocab, (1, n)), device=model.device)
            times = []
            for _ in range(3):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                model(ids).logits[:, -1].argmax(-1).item()
                times.append(time.perf_counter() - start)
            out[n] = statistics.median(times[1:]) * 1e3
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--model", default=None)
    parser.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) / "kv-models"))
    parser.add_argument("--fast-weights", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="256,1024,4096,16384")
    parser.add_argument("--dram", default="8GiB")
    parser.add_argument("--ssd", default="8GiB")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    model_dir = model_dir_for(args)

    from engine import EngineConfig, LLMEngine

    workdir = Path(tempfile.mkdtemp(prefix="ladder-"))
    daemon, _ = start_embedded_daemon(workdir, args.dram, args.ssd)
    max_len = max(lengths) + 16
    num_blocks = sum(-(-n // 16) for n in lengths) * 2 + 64
    engine = LLMEngine(EngineConfig(str(model_dir), device=args.device, kv_offload=True,
                                    kv_store_socket=str(workdir / "kvstore.sock"),
                                    num_kv_blocks=num_blocks, max_model_len=max_len,
                                    max_num_batched_tokens=max(lengths) + 16,
                                    kv_offload_restore="always"))
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size
    prompts = {n: rng.integers(10, vocab, n).tolist() for n in lengths}
    ttft(engine, rng.integers(10, vocab, 64).tolist(), "warmup")  # kernels compiled, store warm
    rows = {n: {"tokens": n} for n in lengths}
    for n in lengths:
        row = rows[n]
        row["cold_ms"] = ttft(engine, prompts[n], f"cold{n}")[0] * 1e3
        engine.offload.wait_idle()
        t, tiers = ttft(engine, prompts[n], f"hbm{n}")
        row["hbm_ms"], row["hbm_tiers"] = t * 1e3, tiers
        engine.reset_prefix_cache()
        t, tiers = ttft(engine, prompts[n], f"dram{n}")
        row["dram_ms"], row["dram_tiers"] = t * 1e3, tiers
        engine.offload.wait_idle()
        engine.reset_prefix_cache()
        print(f"{n:6d} tokens: cold {row['cold_ms']:8.1f} ms  hbm {row['hbm_ms']:7.1f} ms  "
              f"dram {row['dram_ms']:7.1f} ms {tiers}", flush=True)
    daemon.terminate()  # flushes DRAM to SSD
    daemon.wait(120)
    daemon, _ = start_embedded_daemon(workdir, args.dram, args.ssd)
    deadline = time.monotonic() + 30
    while not engine.offload.client.available and time.monotonic() < deadline:
        time.sleep(0.2)
    for n in lengths:
        engine.reset_prefix_cache()
        t, tiers = ttft(engine, prompts[n], f"ssd{n}")
        rows[n]["ssd_ms"], rows[n]["ssd_tiers"] = t * 1e3, tiers
        print(f"{n:6d} tokens: ssd {t * 1e3:8.1f} ms {tiers}", flush=True)
    block_bytes = engine.kv_cache.block_bytes
    offload_stats = engine.stats()["kv_offload"]
    policy = engine.offload.restore_policy
    for n in lengths:  # what the cost-aware mode would have chosen, with what it measured
        nbytes = (n // 16) * block_bytes
        for tier in ("dram", "ssd"):
            rows[n][f"{tier}_auto_restores"] = policy.should_restore(tier, n, nbytes) if (
                n >= 16) else False
    engine.close()
    daemon.terminate()
    daemon.wait(120)
    raw_h2d = raw_h2d_gbps(block_bytes * (max(lengths) // 16), args.device)
    hf = {} if args.no_hf else _hf_prefill_ms(model_dir, lengths, vocab, args.device)
    for n in lengths:
        rows[n]["hf_cold_ms"] = hf.get(n)
        if raw_h2d:
            kv_bytes = (n // 16) * block_bytes
            bound = 1.25 * kv_bytes / (raw_h2d * 1e9) * 1e3 + rows[n]["hbm_ms"]
            rows[n]["dram_target_ms"] = bound
            rows[n]["dram_meets_target"] = rows[n]["dram_ms"] <= bound
    result = {
        "benchmark": "ttft_ladder", "preset": args.preset, "device": args.device,
        "machine": machine_info(), "date": now_iso(),
        "command": command("python -m benchmarks.ttft_ladder", argv),
        "block_bytes": block_bytes, "raw_h2d_gbps": raw_h2d, "rows": list(rows.values()),
        "offload_stats": offload_stats,
    }
    stem = f"ttft_ladder-{args.preset}-{args.device}-{today()}"
    out_dir = write_result(args.out, f"{stem}.json", result, default=str).parent
    _plot(result, out_dir / f"{stem}.png")
    print(f"\n{'tokens':>7} {'cold':>9} {'hbm':>8} {'dram':>8} {'ssd':>8} {'HF cold':>9}"
          "   (ms; * = the cost model would recompute instead)")
    for r in result["rows"]:
        hf_ms = f"{r['hf_cold_ms']:9.1f}" if r.get("hf_cold_ms") else f"{'-':>9}"
        dram = f"{r['dram_ms']:7.1f}{' ' if r['dram_auto_restores'] else '*'}"
        ssd = f"{r['ssd_ms']:7.1f}{' ' if r['ssd_auto_restores'] else '*'}"
        print(f"{r['tokens']:>7} {r['cold_ms']:9.1f} {r['hbm_ms']:8.1f} {dram} {ssd} {hf_ms}")
    print(f"wrote {out_dir / stem}.json")
    return 0


def _plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["rows"]
    xs = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in [("cold_ms", "cold prefill"), ("hf_cold_ms", "HF transformers cold"),
                       ("ssd_ms", "SSD restore (forced)"), ("dram_ms", "DRAM restore"),
                       ("hbm_ms", "HBM hit")]:
        ys = [r.get(key) for r in rows]
        if all(y is not None for y in ys):
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"TTFT ladder, {result['preset']} on {result['machine'].get('gpu') or 'CPU'}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
