"""What a first turn costs beside the store: one engine per configuration, in process, the same
prompts, interleaved rep by rep (so no configuration is always the first or the last to run).

A first turn of an agent's conversation is a shared system prompt (already in HBM) plus a fresh
history: a short prefill over an HBM hit, and a miss at the store. Scenarios, each timed from
``add_request`` to the first token:

- ``alone``: the engine and its daemon are quiet when it arrives.
- ``after-prefill``: it arrives right after another request's fresh prefill step (``--writer-len``
  tokens), whose blocks the engine with write-through saves has just sent to its daemon: their
  device-to-host copies run during the first turn's prefill.
- ``cold``: a fresh prompt of ``--system-len + --turn-len`` tokens, nothing of it in HBM or
  the store (an agent's very first request): its prefill steps and, with write-through, the
  saves of each chunk's blocks while the next chunk computes.
- ``lookup-after-prefill`` (engines with a store): as ``after-prefill``, but only the lookup sent
  on arrival is timed, from ``add_request`` to its reply, with no step in between; whether it
  went out at once or queued behind the saves is counted (``sent_at_once``).

Configurations: ``off`` (no store), ``write-through``, ``evict`` (a store, lookups and resident
blocks published, but no saves while HBM holds everything), and any in ``CONFIGS``. Reported per
scenario and configuration: TTFT and the first-token step's scheduling and execute time
(``StepTiming``; execute includes the device time, read back with the sampled token), medians
and means, and the ratio to ``off`` of the same scenario. JSON to benchmarks/results/.

    python -m benchmarks.first_turn_cost --model-dir DIR --device cuda --reps 12
    python -m benchmarks.first_turn_cost --model-dir /tmp/small --device cpu --reps 2 \\
        --system-len 1024 --turn-len 256 --writer-len 512 --max-model-len 2048 \\
        --num-kv-blocks 512 --dram 1GiB       # smoke (make-model --preset small)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import command, machine_info, now_iso, today, write_result
from engine.config import DEFAULT_MAX_PREFILL_GRAPH_TOKENS
from server.demo import start_embedded_daemon

CONFIGS = {  # name: EngineConfig overrides
    "off": {},
    "write-through": {"kv_offload": True, "kv_offload_policy": "write-through"},
    "evict": {"kv_offload": True, "kv_offload_policy": "evict"},
}
SCENARIOS = ("alone", "after-prefill", "cold")
# Per first turn: its TTFT, ``add_request``'s own time, and its first-token step's phases
# (``StepTiming``: the previous step's saves flushed, arrivals taken, scheduling, execute, the
# whole step).
STEP_KEYS = ("ttft_ms", "add_request_ms", "flush_ms", "add_ms", "schedule_ms", "execute_ms",
             "step_ms", "steps")
LOOKUP = "lookup-after-prefill"


class _Arm:
    """One configuration's engine (and daemon)."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        from engine import EngineConfig, LLMEngine

        self.name = name
        self.daemon = None
        overrides = dict(CONFIGS[name])
        if overrides.get("kv_offload"):
            workdir = Path(tempfile.mkdtemp(prefix="first-turn-"))
            self.daemon, socket_path = start_embedded_daemon(workdir, args.dram, "0")
            overrides["kv_store_socket"] = str(socket_path)
        try:
            self.engine = LLMEngine(EngineConfig(
                str(args.model_dir), device=args.device, num_kv_blocks=args.num_kv_blocks,
                max_model_len=args.max_model_len, max_num_seqs=8,
                max_prefill_graph_tokens=args.max_prefill_graph_tokens, **overrides))
            self.engine.warm_up()
        except BaseException:
            self._stop_daemon()  # no daemon outlives an arm that did not start
            raise
        self.socket_path = overrides.get("kv_store_socket")
        self.samples: dict[str, list[dict]] = {s: [] for s in SCENARIOS}
        self.first_rep: dict[str, list[dict]] = {}
        if self.daemon is not None:
            self.samples[LOOKUP] = []

    def run(self, tag: str, prompt: list[int]) -> dict:
        """Add one request (one output token) and step until its token; its timings."""
        from engine import SamplingParams

        engine = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        started = time.perf_counter()
        engine.add_request(tag, prompt, params)
        added = time.perf_counter()
        steps, step_ms = 0, []
        while True:
            outputs = engine.step()
            steps += 1
            step_ms.append(engine.last_step.total_s * 1e3)
            if any(out.request_id == tag and out.token_ids for out in outputs):
                ttft = time.perf_counter() - started
                timing = engine.last_step
                engine.flush_offload()  # as the server does once the outputs are out
                cached = next(o.num_cached_tokens for o in outputs if o.request_id == tag)
                return {"ttft_ms": ttft * 1e3, "add_request_ms": (added - started) * 1e3,
                        "flush_ms": timing.flush_s * 1e3,
                        "add_ms": timing.add_s * 1e3, "schedule_ms": timing.schedule_s * 1e3,
                        "execute_ms": timing.execute_s * 1e3, "step_ms": timing.total_s * 1e3,
                        "steps": steps, "step_ms_each": step_ms,
                        "cached_tokens": cached}

    def time_lookup(self, tag: str, prompt: list[int]) -> dict:
        """Add a request and wait, without stepping, for the reply to its arrival's lookup (the
        scheduler takes the request as a step would first)."""
        from engine import SamplingParams

        engine = self.engine
        counters = engine.offload.stats()["connector"]
        at_once = counters.get("sent_at_once", 0)
        started = time.perf_counter()
        engine.add_request(tag, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        engine._take_inbox()  # what a step does first: the scheduler takes it, its lookup goes
        added = time.perf_counter()
        job = engine.offload.restores.prefetched.get(tag)
        if job is None:
            raise RuntimeError(f"{tag}: no lookup went out on arrival")
        job.lookup.wait(10.0)
        replied = time.perf_counter()
        sent_at_once = engine.offload.stats()["connector"].get("sent_at_once", 0) > at_once
        return {"add_ms": (added - started) * 1e3, "reply_ms": (replied - added) * 1e3,
                "sent_at_once": sent_at_once}

    def daemon_request_ms(self) -> dict | None:
        """The daemon's own time per verb (count, sum), from its stats."""
        if self.socket_path is None:
            return None
        from kvstore import Client

        with Client(socket_path=self.socket_path) as client:
            return client.stats().get("daemon", {}).get("request_ms")

    def quiesce(self) -> None:
        """Finish what is in flight and let the daemon's copies end."""
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.engine.flush_offload()
        self.engine.offload.wait_idle(30.0)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self._stop_daemon()

    def _stop_daemon(self) -> None:
        if self.daemon is not None:
            self.daemon.terminate()
            self.daemon.wait(60)


def _shifted(tokens: list[int], vocab: int) -> list[int]:
    """Fresh token ids of the same length (no block in common with ``tokens``)."""
    return [10 + (t - 9) % (vocab - 10) for t in tokens]


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "mean": statistics.fmean(values),
            "min": min(values), "max": max(values)}


def measure(args: argparse.Namespace, configs: list[str]) -> dict:
    arms: list[_Arm] = []
    try:
        for name in configs:  # an arm that fails to start leaves none of the others running
            arms.append(_Arm(args, name))
        vocab = arms[0].engine.vocab_size
        rng = np.random.default_rng(args.seed)
        system = rng.integers(10, vocab, args.system_len).tolist()
        for arm in arms:  # the system prompt in every engine's HBM (and its store)
            arm.run("system", system + [11])
            arm.quiesce()
        for rep in range(args.reps):
            turn = system + rng.integers(10, vocab, args.turn_len).tolist()
            writer = rng.integers(10, vocab, args.writer_len).tolist()
            order = arms if rep % 2 == 0 else arms[::-1]
            for arm in order:
                arm.samples["alone"].append(arm.run(f"alone-{rep}", turn))
                arm.quiesce()
            # the same prompts once more, each engine having forgotten them: a fresh turn
            later = _shifted(turn[len(system):], vocab)
            turn = system + later
            for arm in order:
                arm.run(f"writer-{rep}", writer)  # its saves go out as it returns
                arm.samples["after-prefill"].append(arm.run(f"after-{rep}", turn))
                arm.quiesce()
            cold = rng.integers(10, vocab, args.system_len + args.turn_len).tolist()
            for arm in order:
                arm.samples["cold"].append(arm.run(f"cold-{rep}", cold))
                arm.quiesce()
            later = _shifted(later, vocab)
            turn = system + later
            for arm in order:
                if LOOKUP in arm.samples:
                    arm.run(f"writer2-{rep}", _shifted(writer, vocab))
                    arm.samples[LOOKUP].append(arm.time_lookup(f"lookup-{rep}", turn))
                    arm.quiesce()
            if rep == 0:
                for arm in arms:  # the first rep warms what the engines build on first use
                    arm.first_rep = {k: list(v) for k, v in arm.samples.items()}
                    for samples in arm.samples.values():
                        samples.clear()
        out = {}
        for arm in arms:
            out[arm.name] = {
                scenario: {key: _stats([s[key] for s in arm.samples[scenario]])
                           for key in STEP_KEYS}
                for scenario in SCENARIOS}
            if LOOKUP in arm.samples:
                looks = arm.samples[LOOKUP]
                out[arm.name][LOOKUP] = {
                    "add_ms": _stats([s["add_ms"] for s in looks]),
                    "reply_ms": _stats([s["reply_ms"] for s in looks]),
                    "sent_at_once": sum(s["sent_at_once"] for s in looks)}
            out[arm.name]["samples"] = arm.samples
            out[arm.name]["first_rep"] = arm.first_rep  # first use included
            out[arm.name]["offload"] = arm.engine.stats().get("kv_offload")
            out[arm.name]["daemon_request_ms"] = arm.daemon_request_ms()
        return out
    finally:
        for arm in arms:
            arm.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--configs", default="off,write-through,evict")
    p.add_argument("--reps", type=int, default=12, help="timed reps after one warm-up rep")
    p.add_argument("--system-len", type=int, default=4096)
    p.add_argument("--turn-len", type=int, default=700)
    p.add_argument("--writer-len", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--dram", default="16GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prefill-graph-tokens", type=int,
                   default=DEFAULT_MAX_PREFILL_GRAPH_TOKENS)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "off" not in configs:
        raise SystemExit(f"--configs must name off and known ones {sorted(CONFIGS)}: {configs}")
    from server.cli import tune_interpreter

    tune_interpreter()
    points = measure(args, configs)
    base = points["off"]
    for scenario in SCENARIOS:
        for name in configs:
            s = points[name][scenario]
            ratio = s["ttft_ms"]["median"] / base[scenario]["ttft_ms"]["median"]
            s["ttft_ratio_to_off"] = ratio
            print(f"{scenario:>14} {name:>14}: TTFT p50 {s['ttft_ms']['median']:7.2f} ms "
                  f"(mean {s['ttft_ms']['mean']:7.2f}, {ratio:.3f}x off)  schedule p50 "
                  f"{s['schedule_ms']['median']:6.2f}  execute p50 "
                  f"{s['execute_ms']['median']:7.2f} (mean {s['execute_ms']['mean']:7.2f})  "
                  f"steps {s['steps']['median']:.0f}; p50 add_request "
                  f"{s['add_request_ms']['median']:.2f} flush {s['flush_ms']['median']:.2f} "
                  f"take {s['add_ms']['median']:.2f} step {s['step_ms']['median']:.2f}",
                  flush=True)
    for name in configs:
        first = points[name]["first_rep"].get("cold")
        if first:
            print(f"{'cold, rep 0':>14} {name:>14}: TTFT {first[0]['ttft_ms']:7.2f} ms in "
                  f"{first[0]['steps']} steps (first use included)", flush=True)
        each = [s["step_ms_each"] for s in points[name]["samples"]["cold"]]
        if each and all(len(e) == len(each[0]) for e in each):
            print(f"{'cold steps':>14} {name:>14}: p50 ms each "
                  + " ".join(f"{statistics.median(col):.2f}" for col in zip(*each)), flush=True)
    for name in configs:
        look = points[name].get(LOOKUP)
        if look is not None:
            print(f"{LOOKUP} {name:>14}: add p50 {look['add_ms']['median']:.2f} ms, reply p50 "
                  f"{look['reply_ms']['median']:.2f} ms (max {look['reply_ms']['max']:.2f}), "
                  f"sent at once {look['sent_at_once']} of {args.reps - 1}", flush=True)
    result = {"benchmark": "first_turn_cost", "model_dir": str(args.model_dir),
              "device": args.device, "args": vars(args) | {"model_dir": str(args.model_dir)},
              "machine": machine_info(), "date": now_iso(),
              "command": command("python -m benchmarks.first_turn_cost", argv),
              "points": points}
    path = write_result(args.out, f"first-turn-cost-{args.tag or args.device}-{today()}.json",
                        result, indent=1, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
