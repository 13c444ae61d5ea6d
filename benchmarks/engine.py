"""Cold prefill and decode step time of the engine, next to HF transformers (sdpa), same weights.

For each prompt length: the time of the engine step that prefills the whole prompt and samples the
first token (prefix cache off, one chunk), and the time of HF's forward over the same prompt. Then
the median decode step at batch 1 (and --decode-batch): ours, one engine step; HF, one forward of
one new token per sequence with its KV cache. Targets (H100, Qwen3-4B shape): prefill at 16k <= HF;
decode step at batch 1 <= 2 x weight bytes / HBM bandwidth. Writes JSON to benchmarks/results/.

    python -m benchmarks.engine --preset qwen3-4b --device cuda --lengths 1024,4096,16384
    python -m benchmarks.engine --preset tiny --device cpu --lengths 128,512 --reps 3   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import command, machine_info, median_ms, now_iso, today, write_result


def model_dir_for(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from engine.make_model import write_checkpoint

    suffix = "-fast" if args.fast_weights else ""
    folder = Path(args.model_cache) / f"{args.preset}-seed0{suffix}"
    if not (folder / "config.json").exists():
        print(f"writing {args.preset} checkpoint to {folder} ...", file=sys.stderr)
        if args.fast_weights:
            _write_fast_checkpoint(folder, args.preset)
        else:
            write_checkpoint(folder, args.preset, seed=0)
    return folder


def _write_fast_checkpoint(folder: Path, preset: str) -> None:
    """make-model's checkpoint with every bf16 matrix cut from one 64 MiB pool of N(0, 0.02)
    values at varying offsets: seconds instead of minutes for 8 GB. Same shapes and value
    statistics, not independent values: good for timing, not for anything else."""
    from engine import make_model
    from engine.safetensors_writer import encode_values

    rng = np.random.default_rng(0)
    values = rng.standard_normal(32 * 2**20, dtype=np.float32) * np.float32(make_model.INIT_STD)
    pool = memoryview(encode_values(values, "bfloat16"))
    original = make_model.tensor_chunks

    def chunks(spec, generator, num_live_rows=None):
        # The output embedding keeps make-model's zero rows past the tokenizer (visible text).
        if len(spec.shape) == 1 or spec.dtype != "bfloat16" or num_live_rows is not None:
            yield from original(spec, generator, num_live_rows)
            return
        offset = (spec.nbytes // 2 * 7919) % (len(pool) // 2) * 2
        remaining = spec.nbytes
        while remaining:
            take = min(remaining, len(pool) - offset)
            yield pool[offset:offset + take]
            remaining -= take
            offset = 0

    make_model.tensor_chunks = chunks
    try:
        make_model.write_checkpoint(folder, preset, seed=0)
    finally:
        make_model.tensor_chunks = original


def hbm_bandwidth_gbs(num_bytes: int = 2 * 1024**3, reps: int = 5) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), best of ``reps``."""
    import cupy as cp

    src = cp.ones(num_bytes // 2, dtype=cp.uint16)
    dst = cp.empty_like(src)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    best = float("inf")
    for _ in range(reps):
        start.record()
        dst[...] = src
        end.record()
        end.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
    del src, dst
    return 2 * num_bytes / best / 1e9


def bench_ours(model_dir: Path, args: argparse.Namespace, vocab: int,
               eager: bool = False, decode_only: bool = False, prefill_only: bool = False,
               attention: str | None = None) -> dict:
    """The engine's prefill and decode step times; ``attention`` sets KVSTORE_ATTENTION
    (``ours``, ``cudnn``, ``auto``) for this engine only."""
    saved = os.environ.get("KVSTORE_ATTENTION")
    if attention is not None:
        os.environ["KVSTORE_ATTENTION"] = attention
    try:
        return _bench_ours(model_dir, args, vocab, eager, decode_only, prefill_only)
    finally:
        if saved is None:
            os.environ.pop("KVSTORE_ATTENTION", None)
        else:
            os.environ["KVSTORE_ATTENTION"] = saved


def _bench_ours(model_dir: Path, args: argparse.Namespace, vocab: int, eager: bool,
                decode_only: bool, prefill_only: bool) -> dict:
    from engine import EngineConfig, LLMEngine, SamplingParams

    max_len = max(*args.lengths, args.decode_context) + args.decode_steps + 8
    batch = max(args.decode_batch)
    config = EngineConfig(str(model_dir), device=args.device, enable_prefix_caching=False,
                          max_num_batched_tokens=max(args.lengths), max_model_len=max_len,
                          max_num_seqs=max(batch, 1), num_kv_blocks=args.num_kv_blocks,
                          enforce_eager=eager)
    rng = np.random.default_rng(0)
    result: dict = {"prefill_ms": {}, "decode_step_ms": {}, "decode_rows_min": {}}
    with LLMEngine(config) as engine:
        result["attention_backend"] = engine.runner.attention_backend
        counter = iter(range(10**9))

        def prefill(length: int) -> None:
            prompt = rng.integers(3, vocab, length).tolist()
            engine.add_request(f"p{next(counter)}", prompt, SamplingParams(max_tokens=1))
            outs = engine.step()
            assert outs and outs[0].finished, "prefill did not finish in one step"

        for length in [] if decode_only else args.lengths:
            result["prefill_ms"][str(length)] = median_ms(lambda n=length: prefill(n), args.reps)
        for num_seqs in [] if prefill_only else args.decode_batch:
            # long prompts prefill over several steps, and the sequences already prefilled
            # decode meanwhile: leave them tokens enough to still decode in the timed steps
            prefill_steps = num_seqs * (-(-args.decode_context // max(args.lengths)) + 1)
            params = SamplingParams(max_tokens=args.decode_steps + 2 + prefill_steps,
                                    ignore_eos=True)
            for _ in range(num_seqs):
                engine.add_request(f"d{next(counter)}",
                                   rng.integers(3, vocab, args.decode_context).tolist(), params)
            started: set[str] = set()
            for _ in range(prefill_steps + 10):  # the prefills, bounded
                started.update(out.request_id for out in engine.step() if out.token_ids)
                if len(started) == num_seqs:
                    break
            else:
                raise RuntimeError(f"{num_seqs - len(started)} prompts did not finish prefill")
            times, rows = [], []
            for _ in range(args.decode_steps):
                start = time.perf_counter()
                rows.append(sum(bool(out.new_token_ids) for out in engine.step()))
                times.append((time.perf_counter() - start) * 1e3)
            while engine.has_unfinished_requests():
                engine.step()
            result["decode_step_ms"][str(num_seqs)] = statistics.median(times[1:] or times)
            # fewer rows than sequences: the arena could not hold them all (preemption), and
            # the step time is not that batch's
            result["decode_rows_min"][str(num_seqs)] = min(rows)
    result["decode_tokens_per_s"] = {b: round(int(b) * 1e3 / ms)
                                     for b, ms in result["decode_step_ms"].items()}
    return result


def bench_hf(model_dir: Path, args: argparse.Namespace, vocab: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.device == "cuda" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                 attn_implementation="sdpa").to(device).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    result: dict = {"prefill_ms": {}, "decode_step_ms": {}}
    with torch.no_grad():
        for length in args.lengths:
            ids = torch.randint(3, vocab, (1, length), generator=gen).to(device)

            def prefill(ids: torch.Tensor = ids) -> None:
                model(ids, use_cache=False, logits_to_keep=1)
                sync()

            result["prefill_ms"][str(length)] = median_ms(prefill, args.reps)
        for num_seqs in args.decode_batch:
            ids = torch.randint(3, vocab, (num_seqs, 128), generator=gen).to(device)
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(args.decode_steps):
                start = time.perf_counter()
                out = model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                sync()
                times.append((time.perf_counter() - start) * 1e3)
                cache = out.past_key_values
            result["decode_step_ms"][str(num_seqs)] = statistics.median(times[1:] or times)
    return result


def _release_gpu_memory(device: str) -> None:
    if device == "cuda":
        import gc

        import cupy

        gc.collect()
        cupy.get_default_memory_pool().free_all_blocks()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model folder (default: make-model --preset)")
    parser.add_argument("--preset", default="tiny", help="make-model preset when no --model")
    parser.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) / "kvengine"),
                        help="where --preset checkpoints are written once and reused")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--decode-batch", default="1", help="comma-separated batch sizes")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--decode-context", type=int, default=128,
                        help="prompt tokens of each decoding sequence (its KV read every step)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--compare-eager", action="store_true",
                        help="also time decode with CUDA graphs off (--enforce-eager)")
    parser.add_argument("--fast-weights", action="store_true",
                        help="fill the checkpoint from a repeated random pool (timing only)")
    parser.add_argument("--compare-attention", action="store_true",
                        help="also time the engine with our attention (KVSTORE_ATTENTION=ours)")
    parser.add_argument("--name", default="", help="suffix of the result file's name")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.decode_batch = [int(x) for x in args.decode_batch.split(",")]
    model_dir = model_dir_for(args)
    vocab = min(json.loads((model_dir / "config.json").read_text())["vocab_size"], 4000)
    report = {"benchmark": "engine", "model": str(model_dir), "preset": args.preset,
              "device": args.device, "machine": machine_info(),
              "date": now_iso(utc=True),
              "command": command(f"{Path(sys.executable).name} -m benchmarks.engine", argv),
              "ours": bench_ours(model_dir, args, vocab)}
    if args.compare_attention:
        _release_gpu_memory(args.device)  # the next engine sizes its arena from free memory
        report["ours_attention_ours"] = bench_ours(model_dir, args, vocab, attention="ours")
    if args.compare_eager:
        report["ours_eager"] = bench_ours(model_dir, args, vocab, eager=True, decode_only=True)
    if args.device == "cuda":  # the decode bound: 2 x weight bytes / HBM bandwidth, same run
        weight_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        bandwidth = hbm_bandwidth_gbs()
        report["decode_bound"] = {
            "weight_bytes": weight_bytes, "hbm_copy_gbs": round(bandwidth, 1),
            "bound_ms": round(2 * weight_bytes / (bandwidth * 1e9) * 1e3, 2),
            "batch1_ms": round(report["ours"]["decode_step_ms"].get("1", float("nan")), 2)}
        # issue 17: a decode step <= 1.3 x (weight bytes + KV bytes read) / HBM bandwidth
        config = json.loads((model_dir / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        kv_token_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] \
            * head_dim * 2
        context = args.decode_context + args.decode_steps // 2  # the median step's context
        report["decode_kv_bound"] = {}
        for b, ms in report["ours"]["decode_step_ms"].items():
            kv_bytes = int(b) * context * kv_token_bytes
            bound = (weight_bytes + kv_bytes) / (bandwidth * 1e9) * 1e3
            report["decode_kv_bound"][b] = {"context": context, "kv_bytes": kv_bytes,
                                            "bound_ms": round(bound, 2),
                                            "step_ms": round(ms, 2),
                                            "ratio": round(ms / bound, 3)}
    _release_gpu_memory(args.device)  # hand our cached blocks back so torch can have them
    if not args.no_hf:
        report["hf_sdpa"] = bench_hf(model_dir, args, vocab)
        # the cold-prefill target: ours <= 0.75 x HF (sdpa), same run
        report["prefill_ratio_vs_hf"] = {
            n: round(ms / report["hf_sdpa"]["prefill_ms"][n], 3)
            for n, ms in report["ours"]["prefill_ms"].items()}
    print(json.dumps(report, indent=2))
    name = model_dir.name if args.model else args.preset
    suffix = f"-{args.name}" if args.name else ""
    path = write_result(args.out, f"engine-{name}-{args.device}{suffix}-{today()}.json", report)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
