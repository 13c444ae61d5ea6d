"""Multi-turn chat (and agent) load against any OpenAI-compatible endpoint: TTFT, ITL and cache
hits by tier per round.

U users each hold a conversation of R rounds over a shared system prompt of ~S tokens and their
own history (~H tokens at first, growing by each question and answer; in --agentic mode each turn
also brings a ~T-token tool result). Requests arrive as a Poisson process at --qps across users;
an arrival goes to the user that has been idle longest, and a user's next round is only sent after
its previous answer arrived (when every user is waiting, the arrival waits for the first one free,
so the offered rate is capped by U users in a closed loop; the achieved rate is reported).

Each request streams /v1/chat/completions with include_usage, temperature 0, max_tokens=A (and
`ignore_eos` unless --no-ignore-eos), under a timeout; a failure is recorded, never raised. The
client (--client, ``chat_client``) is raw HTTP by default, as vLLM's serving benchmark sends its
requests; `openai` times them through the OpenAI SDK, whose request building and chunk parsing
then count in every TTFT. TTFT runs from just before the request is built to the first content
chunk parsed. Per
request: user, round, prompt tokens (the server's count), cached tokens and cached_tokens_by_tier,
TTFT, inter-token latencies (between content chunks: a chunk may carry several tokens, so the
summary also gives TPOT, time per output token after the first), end-to-end time, error. The run
stops after U x R requests (or --max-requests, or --duration-s) and prints a summary; --output
writes JSON with machine, date, command, config, summary and every record.

    python -m benchmarks.multiturn.load --url http://127.0.0.1:8000 --users 16 --rounds 8 --qps 2 \\
        --system-prompt-len 1024 --history-len 2048 --answer-len 128 --output run.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import command, machine_info, now_iso, write_result
from benchmarks.multiturn.chat_client import CLIENTS, ChatClient, add_client_arg, make_client
from benchmarks.multiturn.request_record import RequestRecord
from benchmarks.multiturn.summary import format_summary, summarize
from benchmarks.workload import Conversation, WorkloadConfig, make_conversations


@dataclass(frozen=True)
class RunConfig:
    """Where to send the load and how; the workload's shape is in `workload`."""

    url: str
    workload: WorkloadConfig
    qps: float
    model: str | None = None
    api_key: str = "EMPTY"
    ignore_eos: bool = True
    request_timeout_s: float = 300.0
    max_requests: int | None = None
    duration_s: float | None = None
    progress: bool = True
    client: str = "http"  # chat_client.CLIENTS

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ValueError(f"client must be one of {', '.join(CLIENTS)}, not {self.client!r}")
        if not self.qps > 0:
            raise ValueError("qps must be > 0 (inf for no pacing)")
        if not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be at least 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("duration_s must be > 0")


async def _stream_one(client: ChatClient, model: str, messages: list[dict],
                      config: RunConfig, record: RequestRecord, started: float) -> str:
    """Send one streaming chat request and fill `record`; returns the answer text."""
    params: dict[str, Any] = {"max_tokens": config.workload.answer_len, "temperature": 0.0,
                              "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        params["ignore_eos"] = True
    if record.request_id is not None:
        params["request_id"] = record.request_id
    sent = time.perf_counter()
    record.sent_s, record.sent_clock_s = sent - started, sent
    pieces: list[str] = []
    last = None
    async with contextlib.aclosing(client.stream(model, messages, params)) as deltas:
        async for delta in deltas:
            now = time.perf_counter()
            if delta.engine is not None:
                record.engine = delta.engine
            if delta.content:
                pieces.append(delta.content)
                record.num_chunks += 1
                if last is None:
                    record.ttft_s = now - sent
                else:
                    record.itl_s.append(now - last)
                last = now
            if delta.usage is not None:
                _take_usage(record, delta.usage)
    record.e2e_s = time.perf_counter() - sent
    if record.ttft_s is None:
        record.error = "no content in the stream"
    return "".join(pieces)


def _take_usage(record: RequestRecord, usage: dict) -> None:
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens")
    by_tier = details.get("cached_tokens_by_tier")
    if isinstance(by_tier, dict):
        record.cached_tokens_by_tier = {str(k): int(v or 0) for k, v in by_tier.items()}


async def _one_round(client: ChatClient, model: str, conv: Conversation, config: RunConfig,
                     scheduled_s: float, started: float, run_id: str) -> RequestRecord:
    record = RequestRecord(user=conv.user, round=conv.round, scheduled_s=scheduled_s,
                           sent_s=time.perf_counter() - started,
                           request_id=f"mt-{run_id}-u{conv.user}-r{conv.round}")
    text = None
    try:
        text = await asyncio.wait_for(
            _stream_one(client, model, conv.next_messages(), config, record, started),
            timeout=config.request_timeout_s)
    except asyncio.TimeoutError:
        record.error = f"timeout after {config.request_timeout_s:g} s"
    except Exception as exc:  # any failure is a recorded outcome, never the end of the run
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    conv.add_answer(text if record.ok else None)
    return record


class _Progress:
    """A tqdm bar of requests done (with the error count), on stderr, only on a terminal."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self._errors = 0
        # disable=None: off when stderr is not a terminal (a log file gets no bar).
        self._bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True,
                         disable=None if enabled else True)

    def update(self, record: RequestRecord) -> None:
        self._errors += 0 if record.ok else 1
        self._bar.update(1)
        if not record.ok:
            self._bar.set_postfix(errors=self._errors, refresh=False)

    def close(self) -> None:
        self._bar.close()


async def run_requests(config: RunConfig) -> tuple[list[RequestRecord], float, str]:
    """Drive the workload to its end; returns (records, wall seconds, model name)."""
    wl = config.workload
    convs = make_conversations(wl)
    total = wl.num_users * wl.num_rounds
    if config.max_requests is not None:
        total = min(total, config.max_requests)
    arrivals = random.Random(f"arrivals:{wl.seed}")
    idle: asyncio.Queue[int] = asyncio.Queue()
    for user in range(wl.num_users):
        idle.put_nowait(user)
    records: list[RequestRecord] = []
    progress = _Progress(total, config.progress)
    client = make_client(config.client, config.url, config.api_key, config.request_timeout_s)
    try:
        model = config.model
        if model is None:
            try:
                model = await client.first_model()
            except Exception as exc:
                raise RuntimeError(f"cannot list the models of {config.url}: {exc}") from exc
        run_id = uuid.uuid4().hex[:12]  # the requests' ids: unique to this run
        started = time.perf_counter()
        stop_at = None if config.duration_s is None else started + config.duration_s
        next_arrival = started
        tasks: set[asyncio.Task] = set()

        async def round_task(user: int, scheduled_s: float) -> None:
            record = await _one_round(client, model, convs[user], config, scheduled_s, started,
                                      run_id)
            records.append(record)
            progress.update(record)
            if not convs[user].done:
                idle.put_nowait(user)

        for i in range(total):
            if i:
                next_arrival += arrivals.expovariate(config.qps) if math.isfinite(config.qps) else 0
            wait_s = next_arrival - time.perf_counter()
            if stop_at is not None:
                wait_s = min(wait_s, stop_at - time.perf_counter())
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            if stop_at is not None and time.perf_counter() >= stop_at:
                break
            try:
                remaining = None if stop_at is None else max(0.0, stop_at - time.perf_counter())
                user = await asyncio.wait_for(idle.get(), timeout=remaining)
            except asyncio.TimeoutError:
                break
            # A late arrival (every user was busy) restarts the clock: no catch-up burst.
            next_arrival = max(next_arrival, time.perf_counter())
            task = asyncio.create_task(round_task(user, next_arrival - started))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks))
        wall_s = time.perf_counter() - started
    finally:
        progress.close()
        await client.aclose()
    records.sort(key=lambda r: (r.sent_s, r.user))
    return records, wall_s, model


def run(config: RunConfig) -> dict:
    """Run the workload; the result with config, summary and every record (no machine/date)."""
    records, wall_s, model = asyncio.run(run_requests(config))
    cfg = asdict(config)
    cfg["model"] = model
    if not math.isfinite(config.qps):
        cfg["qps"] = "inf"
    cfg.pop("api_key", None)
    return {"benchmark": "multiturn", "config": cfg, "summary": summarize(records, wall_s),
            "records": [asdict(r) for r in records]}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m benchmarks.multiturn.load`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="server URL, with or without /v1")
    parser.add_argument("--model", default=None, help="model name (default: the first listed)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--qps", type=float, default=1.0, help="Poisson arrival rate (inf: none)")
    parser.add_argument("--system-prompt-len", type=int, default=1024)
    parser.add_argument("--history-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--answer-len", type=int, default=64, help="max_tokens of each answer")
    parser.add_argument("--agentic", action="store_true",
                        help="each turn brings a long tool result and a short question")
    parser.add_argument("--tool-result-len", type=int, default=1024)
    parser.add_argument("--tokens-per-word", type=float, default=1.3,
                        help="the tokenizer's tokens per generated word, to size the texts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send extra_body ignore_eos (vLLM and kvengine take it)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--duration-s", type=float, default=None,
                        help="send no new request after this many seconds")
    add_client_arg(parser)
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--output", default=None, help="write the JSON result here")
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """A RunConfig from parsed arguments (ValueError on a bad combination)."""
    workload = WorkloadConfig(
        num_users=args.users, num_rounds=args.rounds, system_prompt_len=args.system_prompt_len,
        history_len=args.history_len, answer_len=args.answer_len, question_len=args.question_len,
        agentic=args.agentic, tool_result_len=args.tool_result_len,
        tokens_per_word=args.tokens_per_word, seed=args.seed)
    return RunConfig(url=args.url, workload=workload, qps=args.qps, model=args.model,
                     api_key=args.api_key, ignore_eos=args.ignore_eos,
                     request_timeout_s=args.request_timeout, max_requests=args.max_requests,
                     duration_s=args.duration_s, progress=args.progress,
                     client=args.client)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        result = run(config)
    except RuntimeError as exc:
        print(f"multiturn: error: {exc}", file=sys.stderr)
        return 2
    result = {**result, "machine": machine_info(), "date": now_iso(),
              "command": command("python -m benchmarks.multiturn.load", argv)}
    if args.output:  # written before anything is printed: the records outlive a closed stdout
        write_result(Path(args.output).parent, Path(args.output).name, result)
    print(format_summary(result["summary"]))
    if args.output:
        print(f"wrote {args.output}")
    return 0 if result["summary"]["num_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
