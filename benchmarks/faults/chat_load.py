"""The load of a fault soak: multi-turn chats sent to one engine, with a gate for its restarts.

Users hold conversations (``benchmarks.workload``) and send their rounds in a closed loop: an
arrival (Poisson at ``qps``) goes to the user idle longest, a user's next round leaves only after
its answer came back, and a user whose conversation ended starts a new one (its own text, the
same shared system prompt), so the load lasts as long as the soak. Every request is greedy
(temperature 0, ``ignore_eos``, ``max_tokens`` = the answer length) and non-streaming; a failure
is recorded, never raised, and its round gets a stand-in answer.

The gate is how a fault soak restarts the engine without counting the restart against it:
``pause(fault)`` closes the gate and marks every request in flight at that moment (those may fail:
the engine goes away under them); no request leaves until ``resume(url)`` names the new engine.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import httpx

from benchmarks.faults.chat_request import ask, token_ids_of
from benchmarks.workload import Conversation, WorkloadConfig, system_prompt


@dataclass
class ChatRecord:
    """One request: ``*_s`` seconds from the start of the load; ``engine`` the incarnation it
    was sent to; ``in_flight_at_fault`` the engine stop it was in flight at, if any;
    ``reference`` the reference engine's answer to the same messages (filled in afterwards);
    ``numerics`` how the reference scores an answer that differs from it
    (``benchmarks.faults.answer_scoring``)."""

    index: int
    user: int
    conversation: str
    round: int
    engine: int
    sent_s: float
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens_by_tier: dict[str, int] | None = None
    answer: str | None = None
    answer_token_ids: list[int] | None = None
    error: str | None = None
    in_flight_at_fault: int | None = None
    reference: str | None = None
    reference_error: str | None = None
    numerics: dict | None = None
    messages: list[dict[str, str]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        """Every field but the messages (long, and a function of the seed and the answers)."""
        out = asdict(self)
        out.pop("messages")
        return out


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}: {exc.response.text[:200]}"
    return f"{type(exc).__name__}: {exc}"[:300]


class ChatLoad:
    """Multi-turn chat load against the engine at ``url``; ``start()``, then ``stop()``."""

    def __init__(self, workload: WorkloadConfig, qps: float, model: str, url: str,
                 request_timeout_s: float, t0: float) -> None:
        if not qps > 0 or not request_timeout_s > 0:
            raise ValueError("qps and request_timeout_s must be > 0")
        self.workload = workload
        self.records: list[ChatRecord] = []
        self._qps = qps
        self._model = model
        self._url = url
        self._engine = 1
        self._num_sent = 0
        self._t0 = t0
        self._system = system_prompt(workload)
        self._generation = [0] * workload.num_users
        self._convs = [Conversation(workload, u, self._system) for u in range(workload.num_users)]
        self._idle: queue.Queue[int] = queue.Queue()
        for user in range(workload.num_users):
            self._idle.put(user)
        self._lock = threading.Lock()
        self._in_flight: dict[int, ChatRecord] = {}
        self._gate = threading.Event()
        self._gate.set()
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=request_timeout_s)
        self._pool = ThreadPoolExecutor(workload.num_users, thread_name_prefix="chat")
        self._dispatcher = threading.Thread(target=self._dispatch, name="chat-dispatch",
                                            daemon=True)

    def start(self) -> None:
        self._dispatcher.start()

    def pause(self, fault_index: int) -> list[int]:
        """Close the gate; mark and return the requests in flight now (they may fail)."""
        with self._lock:
            self._gate.clear()
            for record in self._in_flight.values():
                record.in_flight_at_fault = fault_index
            return sorted(self._in_flight)

    def resume(self, url: str, engine: int) -> None:
        """Open the gate onto the engine at ``url`` (incarnation ``engine``)."""
        with self._lock:
            self._url, self._engine = url, engine
            self._gate.set()

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def stop(self) -> None:
        """Send nothing more; wait for the requests in flight (each ends by its timeout)."""
        self._stop.set()
        self._dispatcher.join()
        self._pool.shutdown(wait=True)
        self._client.close()
        self.records.sort(key=lambda r: r.index)

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _dispatch(self) -> None:
        arrivals = random.Random(f"arrivals:{self.workload.seed}")
        next_arrival = self._now()
        while not self._stop.wait(max(0.0, next_arrival - self._now())):
            try:
                user = self._idle.get(timeout=0.2)
            except queue.Empty:
                continue
            while not self._gate.wait(0.2):
                if self._stop.is_set():
                    return
            with self._lock:
                if not self._gate.is_set() or self._stop.is_set():  # closed just now
                    self._idle.put(user)
                    continue
                conv = self._convs[user]
                record = ChatRecord(index=self._num_sent, user=user,
                                    conversation=f"{user}.{self._generation[user]}",
                                    round=conv.round, engine=self._engine, sent_s=self._now(),
                                    messages=conv.next_messages())
                self._in_flight[record.index] = record
                self._num_sent += 1
                url = self._url
            self._pool.submit(self._send, record, url)
            # A late arrival (every user busy, or the gate closed) restarts the clock.
            next_arrival = max(next_arrival, self._now()) + arrivals.expovariate(self._qps)

    def _send(self, record: ChatRecord, url: str) -> None:
        started = time.monotonic()
        try:
            body = ask(self._client, url, self._model, record.messages,
                       self.workload.answer_len, token_ids=True)
            usage = body.get("usage") or {}
            choice = body["choices"][0]
            record.answer = choice["message"]["content"]
            record.answer_token_ids = token_ids_of(choice["logprobs"]["content"])
            record.prompt_tokens = usage.get("prompt_tokens")
            record.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens_by_tier = details.get("cached_tokens_by_tier")
        except Exception as exc:  # every failure is a recorded outcome
            record.error = describe_error(exc)
        record.e2e_s = time.monotonic() - started
        with self._lock:
            del self._in_flight[record.index]
            self.records.append(record)
            conv = self._convs[record.user]
            conv.add_answer(record.answer if record.error is None else None)
            if conv.done:  # a new conversation: its own seed, the same system prompt
                self._generation[record.user] += 1
                seed = self.workload.seed + 1000 * self._generation[record.user]
                self._convs[record.user] = Conversation(replace(self.workload, seed=seed),
                                                        record.user, self._system)
        self._idle.put(record.user)


def answer_again(records: list[ChatRecord], url: str, model: str, max_tokens: int,
                 concurrency: int, timeout_s: float) -> None:
    """Fill ``reference`` (or ``reference_error``) of every answered record with the answer of
    the engine at ``url`` to the same messages."""
    todo = [r for r in records if r.error is None]

    with httpx.Client(timeout=timeout_s) as client:
        def one(record: ChatRecord) -> None:
            try:
                body = ask(client, url, model, record.messages, max_tokens)
                record.reference = body["choices"][0]["message"]["content"]
            except Exception as exc:  # recorded: an uncompared answer fails the verdict
                record.reference_error = describe_error(exc)

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, todo))
