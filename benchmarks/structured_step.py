"""Decode-step cost of structured outputs: a batch of 32 with one JSON-schema request against the
same batch free (DESIGN.md: at most 1.1x), and with every row constrained, for scale.

One engine (``benchmarks.engine``'s checkpoints: make-model presets, ``--fast-weights`` for the
qwen3-4b shape in seconds); ``--batch`` requests of ``--context`` prompt tokens each, generating
with ``ignore_eos``. The constrained rows follow a schema whose answer is one long string (of at
least 4,096 characters, so no row can finish inside the run, and a string is where llguidance's
mask is the most expensive: nearly every token is allowed), so every timed step computes and
applies masks.
Per configuration the batch is prefilled, warmed for a few steps, then ``--steps`` decode steps
are timed one by one (``LLMEngine.step`` wall time: forward, masks, sampling, bookkeeping), the
configurations alternating ``--reps`` times.

    python -m benchmarks.structured_step --preset qwen3-4b --fast-weights --device cuda
    python -m benchmarks.structured_step --preset tiny --device cpu --batch 4 --steps 4 --reps 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import command, machine_info, now_iso, today, write_result
from benchmarks.engine import model_dir_for

# The string cannot close before 4,096 characters: no constrained row finishes inside the run
# (a token is far shorter than 4,096 / (the timed steps and warm-up) characters).
LONG_STRING = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 4096,
                                                           "maxLength": 100000}},
               "required": ["answer"], "additionalProperties": False}
CONFIGS = {"free": 0, "one_json": 1, "all_json": None}  # constrained rows (None: every row)


def _time_config(engine, num_constrained: int, args: argparse.Namespace, rep: int) -> list[float]:
    from engine import SamplingParams

    rng = np.random.default_rng(rep)
    vocab = engine.tokenizer.vocab_size
    # Chunked prefill lets the first requests decode while later ones still prefill: each may
    # run ahead by one token per prefill step, so none may finish before the timed steps end.
    # Decodes take their share of each step's budget first, so the prefill may take more steps
    # than its tokens over the budget: the margin below covers one step per request as well.
    prefill_steps = -(-args.batch * args.context // engine.config.max_num_batched_tokens) + 1
    max_tokens = args.steps + args.warmup + prefill_steps + args.batch + 2
    for i in range(args.batch):
        prompt = rng.integers(0, vocab, args.context).tolist()
        constrained = i < num_constrained
        params = SamplingParams(
            temperature=1.0, seed=i, ignore_eos=True, max_tokens=max_tokens,
            structured_outputs={"json": LONG_STRING} if constrained else None)
        engine.add_request(f"r{rep}-{num_constrained}-{i}", prompt, params)
    for _ in range(max_tokens - args.steps - args.warmup):  # chunked prefill: all decode
        engine.step()
        if engine.stats()["num_running"] == args.batch and engine.last_step.num_tokens == \
                args.batch:
            break
    else:
        raise RuntimeError(f"the batch did not reach {args.batch} decoding sequences in "
                           f"{max_tokens - args.steps - args.warmup} steps: {engine.stats()}")
    for _ in range(args.warmup):
        engine.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
        if engine.last_step.num_seqs != args.batch:
            raise RuntimeError(f"a timed step ran {engine.last_step.num_seqs} sequences, "
                               f"not {args.batch} (step {len(times)} of {args.steps}, "
                               f"max_tokens {max_tokens}): {engine.last_step} {engine.stats()}")
    for i in range(args.batch):
        engine.abort_request(f"r{rep}-{num_constrained}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured_step",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model folder (default: make-model --preset)")
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) / "kvengine"))
    parser.add_argument("--fast-weights", action="store_true",
                        help="make-model weights cut from one random pool (timing only)")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--name", default="", help="suffix of the result file's name")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    from engine import EngineConfig, LLMEngine

    model_dir = model_dir_for(args)
    blocks = args.num_kv_blocks or args.batch * (-(-(args.context + args.steps + args.warmup
                                                     + args.batch + 16) // 16) + 1)
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), device=args.device,
                                    num_kv_blocks=blocks, max_num_seqs=args.batch,
                                    max_model_len=args.context + args.steps + args.warmup
                                    + args.batch + 64))
    engine.warm_up()
    steps: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for rep in range(args.reps):
        for name, num_constrained in CONFIGS.items():
            count = args.batch if num_constrained is None else num_constrained
            steps[name] += _time_config(engine, count, args, rep)
            print(f"rep {rep} {name}: median step {statistics.median(steps[name]):.3f} ms",
                  file=sys.stderr)
    engine.close()
    medians = {name: statistics.median(t) for name, t in steps.items()}
    result = {
        "command": command("python -m benchmarks.structured_step", argv), "when": now_iso(),
        "machine": machine_info(), "model": str(model_dir), "device": args.device,
        "batch": args.batch, "context": args.context, "steps": args.steps, "reps": args.reps,
        "schema": LONG_STRING,
        "step_ms": {name: {"median": round(medians[name], 4),
                           "p90": round(float(np.percentile(t, 90)), 4),
                           "mean": round(statistics.fmean(t), 4)} for name, t in steps.items()},
        "ratio_one_json": round(medians["one_json"] / medians["free"], 4),
        "ratio_all_json": round(medians["all_json"] / medians["free"], 4),
        "target_ratio_one_json": 1.1,
    }
    print(f"free {medians['free']:.3f} ms, one JSON-schema row {medians['one_json']:.3f} ms "
          f"({result['ratio_one_json']:.3f}x, target <= 1.1x), every row "
          f"{medians['all_json']:.3f} ms ({result['ratio_all_json']:.3f}x)")
    suffix = f"-{args.name}" if args.name else ""
    path = write_result(args.out, f"structured_step-{args.preset}-{args.device}{suffix}-"
                        f"{today()}.json", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
