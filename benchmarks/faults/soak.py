"""A soak under faults: the long-context multi-turn preset against `kvengine serve --kv-offload`
and `kvstore serve` for ``--minutes`` while a seeded schedule stops, kills and restarts them.

The stack: one daemon (DRAM pool about half the preset's working set, an SSD tier that survives
its restarts) and one engine whose KV pool holds a third of the users' contexts (the preset's
pressure regime), so turns restore from DRAM and SSD. The load (``benchmarks.faults.chat_load``):
the preset's users in a closed loop at ``--qps``, each request greedy with a fixed answer length.
The faults (``benchmarks.faults.schedule``, applied by ``benchmarks.faults.injector``): daemon
SIGSTOP then SIGCONT, daemon SIGKILL and restart on the same socket, engine SIGTERM or SIGKILL
and restart (new requests wait at a gate while the engine is down).

Afterwards, every answer is compared with a reference: the same messages answered by a fresh
engine without ``--kv-offload`` and without a prefix cache, started once the stack under test has
stopped. Afterwards rather than alongside, so the reference never shares the CPU or GPU with the
engine under test (its timings and memory are the stack's alone) and no fault can touch it; every
request is judged on its own messages, whatever answers came before.

Memory (host from /proc, GPU from nvidia-smi) of the daemon and the engine is read after start
and warm-up (the baseline) and after the load (``benchmarks.process_memory``); the verdict
(``benchmarks.faults.verdict``) judges answers, failures, faults and memory. JSON to
``--out``/fault-soak-<machine>-<date>.json; exit status 0 when the verdict passes, 1 when not.

    python -m benchmarks.faults.soak --model-dir DIR --device cuda           # 10 min on a GPU
    python -m benchmarks.faults.soak --model-dir /tmp/tiny --device cpu --scale 0.1 \\
        --qps 1 --machine vm-2cpu                                             # CPU, tiny model
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.common import command, machine_info, now_iso, today, write_result
from benchmarks.faults.answer_scoring import ask_again, score_differences, self_variance
from benchmarks.faults.chat_load import ChatLoad, answer_again
from benchmarks.faults.injector import FaultInjector
from benchmarks.faults.schedule import FaultKind, describe, make_schedule, parse_kinds
from benchmarks.faults.stack import MODEL_NAME, SoakStack, StackConfig
from benchmarks.faults.verdict import verdict
from benchmarks.multiturn.presets import PRESETS, scaled
from benchmarks.process_memory import snapshot
from benchmarks.servers import warm_up
from benchmarks.sizing import model_shape, plan_sizing, tokens_per_word_of
from kvstore.cli.args import positive_float_arg, positive_int_arg, size_arg

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N (default: cuda)")
    p.add_argument("--minutes", type=positive_float_arg, default=10.0, help="of load")
    p.add_argument("--preset", choices=sorted(PRESETS), default="long-context")
    p.add_argument("--scale", type=positive_float_arg, default=1.0,
                   help="multiply every length of the preset, in (0, 1] (CPU runs)")
    p.add_argument("--users", type=positive_int_arg, default=None)
    p.add_argument("--qps", type=positive_float_arg, default=None)
    p.add_argument("--faults", default="all", help="fault kinds, comma-separated: all or "
                   + ", ".join(kind.value for kind in FaultKind))
    p.add_argument("--fault-every", type=positive_float_arg, default=60.0, help="seconds")
    p.add_argument("--first-fault-s", type=positive_float_arg, default=None,
                   help="quiet start (default: half a fault interval)")
    p.add_argument("--tail-s", type=positive_float_arg, default=None,
                   help="quiet end (default: a fault interval)")
    p.add_argument("--stop-s", type=positive_float_arg, default=10.0,
                   help="a daemon-stop lasts 0.5 to 1 x this")
    p.add_argument("--seed", type=int, default=0, help="of the fault schedule")
    p.add_argument("--dram", type=size_arg, default=None,
                   help="daemon DRAM pool (default: half the working set)")
    p.add_argument("--ssd-size", type=size_arg, default=None, help="daemon SSD tier, 0: none "
                   "(default: the working set, at most a quarter of the free disk)")
    p.add_argument("--num-kv-blocks", type=positive_int_arg, default=None,
                   help="engine KV pool (default: the preset's pressure regime)")
    p.add_argument("--max-model-len", type=positive_int_arg, default=None)
    p.add_argument("--block-size", type=positive_int_arg, default=16)
    p.add_argument("--engine-args", default="", help="more `kvengine serve` flags, one string")
    p.add_argument("--request-timeout", type=positive_float_arg, default=300.0)
    p.add_argument("--start-timeout", type=positive_float_arg, default=600.0)
    p.add_argument("--reference-concurrency", type=positive_int_arg, default=4)
    p.add_argument("--numerics-margin", type=positive_float_arg, default=0.25,
                   help="an answer that differs from the reference's passes when, scored by "
                        "the reference token by token, each token's distance from the "
                        "reference's best is within this share of the spread of its top "
                        "--numerics-top-n (bf16 near-ties; default 0.25)")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the reference's own numerics first: it answers a sample of "
                        "the requests again one at a time, and the largest share its own "
                        "differences need raises --numerics-margin if larger (default: on)")
    p.add_argument("--calibrate-requests", type=positive_int_arg, default=96,
                   help="how many requests the calibration asks again (evenly spread)")
    p.add_argument("--score-budget-s", type=positive_float_arg, default=900.0,
                   help="the calibration's and the scoring's time, from the reference's first "
                        "pass on: an answer not scored by then counts as unexplained (the "
                        "verdict fails, saying so); one answer's scoring is checked whole")
    p.add_argument("--numerics-top-n", type=positive_int_arg, default=20,
                   help="alternatives the reference reports per position (a token outside "
                        "them fails the answer)")
    p.add_argument("--memory-tolerance", type=float, default=0.05,
                   help="heap or GPU memory may grow by this share of its baseline ...")
    p.add_argument("--memory-slack", type=size_arg, default=64 * 2**20,
                   help="... plus this (SIZE)")
    p.add_argument("--settle-s", type=positive_float_arg, default=None,
                   help="wait after the load before the memory is read again, and on cuda "
                        "after the warm-up before the baseline too (default: 5 s on cpu, 40 s on "
                        "cuda, where the engine's cuDNN plan builder leaves 30 s after its last "
                        "build and gives its CUDA context back: the baseline must not count it)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the socket and SSD files go (default: the temp folder)")
    p.add_argument("--machine", default=socket.gethostname().split(".")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return p


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple:
    """The workload, its sizing and the fault schedule; bad arguments end in parser.error."""
    if not _DEVICE.fullmatch(args.device):
        parser.error(f"--device {args.device!r}: cpu, cuda or cuda:N")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir}: no config.json")
    if args.scale > 1:
        parser.error("--scale must be in (0, 1]")
    if args.memory_tolerance < 0:
        parser.error("--memory-tolerance must not be negative")
    preset = PRESETS[args.preset]
    block_bytes, max_positions = model_shape(args.model_dir, args.block_size)
    tokens_per_word = tokens_per_word_of(args.model_dir, 0) or 1.3
    workload = replace(scaled(preset["workload"], args.scale), tokens_per_word=tokens_per_word)
    workload = replace(workload, num_users=args.users or workload.num_users)
    longest = workload.last_prompt_len() + workload.answer_len
    if longest > (args.max_model_len or max_positions):
        parser.error(f"the preset's longest conversation (~{longest} tokens) is longer than "
                     f"{args.max_model_len or max_positions} tokens: lower --scale")
    plan = plan_sizing(workload, block_bytes, max_positions, block_size=args.block_size,
                       pressure_factor=preset["pressure_factor"],
                       max_model_len=args.max_model_len, pressure_kv_blocks=args.num_kv_blocks)
    ws_bytes = plan["working_set_bytes_est"]
    work_root = args.work_dir or Path(tempfile.gettempdir())
    free = shutil.disk_usage(work_root).free
    sizing = {"block_bytes": block_bytes, "max_model_len": plan["max_model_len"],
              "working_set_bytes_est": ws_bytes,
              "num_kv_blocks": plan["regimes"]["pressure"]["num_kv_blocks"],
              "dram_bytes": args.dram or max(ws_bytes // 2, 16 * 2**20),
              "ssd_bytes": (args.ssd_size if args.ssd_size is not None
                            else max(min(ws_bytes, free // 4), 16 * 2**20))}
    try:
        kinds = parse_kinds(args.faults)
        faults = make_schedule(args.minutes * 60, args.fault_every, args.seed, kinds,
                               args.stop_s, args.first_fault_s, args.tail_s)
    except ValueError as exc:
        parser.error(str(exc))
    return workload, args.qps or preset["qps"], sizing, faults


def _wait_for_rest(stack: SoakStack, limit_s: float) -> None:
    """Until the daemon holds no lease (the engine's last loads released), or ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        stats = stack.daemon_stats() or {}
        if (stats.get("daemon") or {}).get("leases_active") == 0:
            return
        time.sleep(0.5)


def _drive(stack: SoakStack, load: ChatLoad, injector: FaultInjector, t0: float,
           duration_s: float, tail_s: float) -> float:
    """Let the load and the faults run for ``duration_s`` (and, if the faults ran late, until
    ``tail_s`` after the last recovered); the load's length in seconds."""
    load.start()
    injector.start()
    next_report = 30.0
    while True:
        now = time.monotonic() - t0
        if injector.error:
            break
        if now >= duration_s and injector.finished() and (
                injector.done_s is None or now >= injector.done_s + tail_s):
            break
        if now >= next_report:
            records = list(load.records)
            print(f"fault soak: {now:6.0f} s, {len(records)} answered or failed "
                  f"({sum(r.error is not None for r in records)} failed), "
                  f"{load.num_in_flight()} in flight", flush=True)
            next_report += 30.0
        time.sleep(0.5)
    injector.stop()
    load.stop()
    return time.monotonic() - t0


def _memory(stack: SoakStack, gpu: bool, ordinals: tuple[int, ...]) -> dict:
    """The processes' and devices' memory, and the engine's allocator (``held``, ``in_use``)."""
    out = snapshot(stack.pids(), gpu, ordinals)
    engine = out["processes"].get("engine")
    if engine is not None:
        engine["allocator"] = stack.engine_allocator_bytes()
    return out


def _settle_s(args: argparse.Namespace, gpu: bool) -> float:
    """``--settle-s``, else its default: 40 s on cuda (the plan builder's CUDA context lingers
    30 s after its last build), 5 s on cpu."""
    return args.settle_s or (40.0 if gpu else 5.0)


def run(args: argparse.Namespace, workload, qps: float, sizing: dict, faults: list) -> dict:
    """Start the stack, soak it under the faults, ask the reference; the result (no verdict)."""
    gpu = args.device.startswith("cuda")
    workdir = Path(tempfile.mkdtemp(prefix="kv-fault-soak-", dir=args.work_dir))
    config = StackConfig(
        model_dir=args.model_dir, device=args.device, workdir=workdir,
        dram_bytes=sizing["dram_bytes"], ssd_bytes=sizing["ssd_bytes"],
        num_kv_blocks=sizing["num_kv_blocks"], max_model_len=sizing["max_model_len"],
        max_num_seqs=workload.num_users, block_size=args.block_size,
        start_timeout_s=args.start_timeout, engine_args=tuple(shlex.split(args.engine_args)))
    warm_len = min(workload.last_prompt_len(), sizing["max_model_len"] - workload.answer_len - 64)

    def warm(url: str) -> None:
        warm_up(url, workload.answer_len, workload.tokens_per_word, warm_len)

    stack = SoakStack(config, warm)
    out: dict = {"error": None}
    load = None
    try:
        stack.start_daemon()
        listening_s, warm_s = stack.start_engine()
        out["engine_start_s"] = {"listening": listening_s, "warm": warm_s}
        # On cuda, a plan builder the warm-up started holds a CUDA context for 30 s more: the
        # baseline waits for it as the reading after the load does, else it counts memory that
        # is gone by then and hides as much growth.
        time.sleep(_settle_s(args, gpu) if gpu else 1.0)
        ordinals = (int(args.device.partition(":")[2] or 0),) if gpu else ()
        out["memory_before"] = _memory(stack, gpu, ordinals)
        t0 = time.monotonic()
        load = ChatLoad(workload, qps, MODEL_NAME, stack.url, args.request_timeout, t0)
        injector = FaultInjector(stack, load, faults, t0,
                                 log=lambda line: print(line, flush=True))
        tail_s = args.tail_s or args.fault_every
        out["load_s"] = _drive(stack, load, injector, t0, args.minutes * 60, min(tail_s, 30.0))
        out["outcomes"], out["error"] = injector.outcomes, injector.error
        time.sleep(_settle_s(args, gpu))
        _wait_for_rest(stack, 30.0)
        out["memory_after"] = _memory(stack, gpu, ordinals)
        stats = stack.daemon_stats() or {}
        out["daemon_final"] = {k: stats.get(k) for k in ("tiers", "counters", "daemon")}
        out["engine_final_offload_events"] = stack.engine_offload_events()
        out["incarnations"] = {"daemon": stack.daemon_incarnation,
                               "engine": stack.engine_incarnation}
    finally:
        for role, proc in (("daemon", stack.daemon), ("engine", stack.engine)):
            if proc is not None:
                out[f"{role}_log_tail"] = list(proc.lines)[-15:]
        stack.close()
        shutil.rmtree(workdir, ignore_errors=True)
    records = load.records
    blocks = max(sizing["num_kv_blocks"], args.reference_concurrency
                 * -(-sizing["max_model_len"] // args.block_size) + 16)
    started = time.monotonic()
    print(f"fault soak: the reference engine answers {len(records)} requests again", flush=True)
    reference, url = stack.reference_engine(blocks)
    try:
        answer_again(records, url, MODEL_NAME, workload.answer_len, args.reference_concurrency,
                     args.request_timeout)
        scored = time.monotonic()
        deadline = scored + args.score_budget_s
        again = ask_again(records, url, MODEL_NAME, workload.answer_len,
                          args.calibrate_requests, args.request_timeout, deadline) \
            if args.calibrate else None
    finally:
        reference.stop()
    scorer, url = stack.reference_engine(blocks, prefix_cache=True)
    try:
        margin = args.numerics_margin
        if again is not None:
            out["calibration"] = calibration = self_variance(
                again, url, MODEL_NAME, args.numerics_top_n, args.reference_concurrency,
                args.request_timeout, deadline)
            margin = max(margin, calibration["largest_share"])
            print(f"fault soak: the reference against itself: {calibration['differences']} of "
                  f"{calibration['asked']} answers differ, largest share "
                  f"{calibration['largest_share']:.3f}; numerics margin {margin:.3f}", flush=True)
        out["numerics_margin_used"] = margin
        score_differences(records, url, MODEL_NAME, args.numerics_top_n, margin,
                          args.reference_concurrency, args.request_timeout, deadline)
    finally:
        scorer.stop()
    out["reference"] = {"command": " ".join(reference.cmd[1:]), "num_kv_blocks": blocks,
                        "concurrency": args.reference_concurrency,
                        "scorer_command": " ".join(scorer.cmd[1:]),
                        "answer_seconds": scored - started,
                        "score_seconds": time.monotonic() - scored,
                        "seconds": time.monotonic() - started}
    out["records"] = [r.to_json() for r in records]
    return out


def _print_report(result: dict) -> None:
    v = result["verdict"]
    print(f"\nfault soak: {v['requests']} requests, {v['answers']['answered']} answered, "
          f"{len(v['answers']['differences'])} differences "
          f"({len(v['answers']['unexplained'])} beyond the numerics margin, largest share "
          f"{v['answers']['largest_share']}, median spread {v['answers']['median_spread']}), "
          f"{v['failures']['failed']} failed "
          f"({len(v['failures']['allowed'])} in flight at an engine stop)")
    for f in v["fault_windows"]["faults"]:
        d = f["during"]
        print(f"  #{f['index']:<2} {f['kind']:<12} at {f['at_s']:7.1f} s, recovered in "
              f"{f['recovered_s']:6.2f} s; {d['num']} requests overlapped ({d['failed']} "
              f"failed), e2e p50 {d['e2e_s_p50']} s max {d['e2e_s_max']} s; "
              f"{f['answered_after']} answered after")
    quiet = v["fault_windows"]["outside_faults"]
    print(f"  outside faults: {quiet['num']} requests, e2e p50 {quiet['e2e_s_p50']} s, "
          f"p99 {quiet['e2e_s_p99']} s")
    for item in v["memory"]["items"]:
        judged = "reported, not judged" if item["limit"] is None else \
            f"limit {item['limit']}: {item['ok']}"
        print(f"  memory {item['what']}: {item['before']} -> {item['after']} ({judged})")
    for name, ok in v["checks"].items():
        print(f"  {name}: {'pass' if ok else 'FAIL'}")
    print(f"verdict: {'PASS' if v['passed'] else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    workload, qps, sizing, faults = _plan(args, parser)
    print(f"fault soak: {args.preset} x{args.scale:g}, {workload.num_users} users, {qps:g} req/s, "
          f"{args.minutes:g} min on {args.device}; schedule (seed {args.seed}):\n"
          + describe(faults), flush=True)
    try:
        out = run(args, workload, qps, sizing, faults)
    except RuntimeError as exc:
        print(f"fault soak: error: {exc}", file=sys.stderr)
        return 2
    schedule = [f.to_json() for f in faults]
    result = {
        "benchmark": "fault_soak", "machine": machine_info(), "machine_name": args.machine,
        "date": today(), "time": now_iso(),
        "command": command("python -m benchmarks.faults.soak", argv),
        "config": {"preset": args.preset, "scale": args.scale, "device": args.device,
                   "minutes": args.minutes, "qps": qps, "seed": args.seed,
                   "fault_every_s": args.fault_every, "stop_s": args.stop_s,
                   "memory_tolerance": args.memory_tolerance,
                   "numerics_margin": args.numerics_margin,
                   "numerics_top_n": args.numerics_top_n,
                   "memory_slack_bytes": args.memory_slack,
                   "model_dir": str(args.model_dir)},
        "workload": asdict(workload), "sizing": sizing, "schedule": schedule,
        "note": ("CPU run of a tiny random-weight model: it proves the fault handling and the "
                 "answers, not GPU memory or H100 timings" if args.device == "cpu" else None),
        **out,
    }
    result["verdict"] = verdict(result["records"], schedule, result.get("outcomes", []),
                                result.get("memory_before", {"processes": {}}),
                                result.get("memory_after", {"processes": {}}),
                                args.memory_tolerance, args.memory_slack)
    if result["error"]:
        result["verdict"]["passed"] = False
    _print_report(result)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.machine)
    name = f"fault-soak-{slug}-{result['date']}.json"
    print(f"wrote {write_result(args.out, name, result)}")
    return 0 if result["verdict"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
