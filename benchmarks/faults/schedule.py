"""The fault schedule of ``benchmarks.faults.soak``: which fault, when, seeded and printable.

Four kinds of fault, each on the stack of one ``kvstore serve`` daemon and one ``kvengine serve
--kv-offload`` engine:

- ``daemon-stop``: SIGSTOP the daemon, SIGCONT it ``hold_s`` seconds later (a hung store);
- ``daemon-kill``: SIGKILL the daemon, start a new one on the same socket and SSD folder;
- ``engine-term``: SIGTERM the engine (uvicorn drains for a few seconds), start a new one;
- ``engine-kill``: SIGKILL the engine, start a new one.

Faults sit about ``every_s`` apart (each moved by up to a fifth of that, seeded), after a quiet
start of ``first_s`` and before a quiet tail of ``tail_s``. The kinds come in rounds, each round
every kind once in a seeded order, so a schedule with room for as many faults as kinds holds each
kind at least once (a schedule without that room is refused).
"""

from __future__ import annotations

import enum
import random
from dataclasses import asdict, dataclass


class FaultKind(str, enum.Enum):
    """What a fault does to the stack (the names travel: they are the JSON's and the CLI's)."""

    DAEMON_STOP = "daemon-stop"
    DAEMON_KILL = "daemon-kill"
    ENGINE_TERM = "engine-term"
    ENGINE_KILL = "engine-kill"

    @property
    def stops_engine(self) -> bool:
        """Requests in flight when this fault strikes may fail (the engine goes away)."""
        return self in (FaultKind.ENGINE_TERM, FaultKind.ENGINE_KILL)


ALL_KINDS = tuple(FaultKind)


@dataclass(frozen=True)
class Fault:
    """One planned fault: ``at_s`` seconds after the load started; ``hold_s`` how long a
    ``daemon-stop`` keeps the daemon stopped (0 for the other kinds)."""

    index: int
    at_s: float
    kind: FaultKind
    hold_s: float = 0.0

    def to_json(self) -> dict:
        out = asdict(self)
        out["kind"] = self.kind.value
        return out


def parse_kinds(text: str) -> tuple[FaultKind, ...]:
    """Comma-separated kind names (``all`` for every kind); ValueError names the unknown ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return ALL_KINDS
    known = {k.value: k for k in FaultKind}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown fault kind(s) {', '.join(unknown) or '(none given)'}; "
                         f"known: all, {', '.join(known)}")
    return tuple(dict.fromkeys(known[n] for n in names))


def make_schedule(duration_s: float, every_s: float, seed: int,
                  kinds: tuple[FaultKind, ...] = ALL_KINDS, stop_s: float = 10.0,
                  first_s: float | None = None, tail_s: float | None = None) -> list[Fault]:
    """Faults about ``every_s`` apart in ``[first_s, duration_s - tail_s]`` (defaults: half an
    interval in, one interval before the end); a ``daemon-stop`` holds for 0.5 to 1 x
    ``stop_s``. ValueError when the window has no room for every kind once."""
    if not duration_s > 0 or not every_s > 0 or not stop_s > 0:
        raise ValueError("duration, fault interval and stop time must be > 0")
    if not kinds:
        raise ValueError("no fault kinds")
    first_s = every_s / 2 if first_s is None else first_s
    tail_s = every_s if tail_s is None else tail_s
    last_s = duration_s - tail_s
    num_slots = int((last_s - first_s) // every_s) + 1 if last_s >= first_s else 0
    if num_slots < len(kinds):
        raise ValueError(
            f"{duration_s:g} s with a fault every {every_s:g} s (first at {first_s:g} s, "
            f"{tail_s:g} s quiet at the end) has room for {num_slots} fault(s), fewer than the "
            f"{len(kinds)} kinds: run longer or fault more often")
    rng = random.Random(f"fault-schedule:{seed}")
    order: list[FaultKind] = []
    while len(order) < num_slots:
        round_kinds = list(kinds)
        rng.shuffle(round_kinds)
        order += round_kinds
    faults = []
    for i in range(num_slots):
        jitter = rng.uniform(-0.2, 0.2) * every_s if 0 < i < num_slots - 1 else 0.0
        kind = order[i]
        hold = round(rng.uniform(0.5, 1.0) * stop_s, 2) if kind is FaultKind.DAEMON_STOP else 0.0
        faults.append(Fault(i, round(first_s + i * every_s + jitter, 2), kind, hold))
    return faults


def describe(faults: list[Fault]) -> str:
    """One line per fault, for the log."""
    lines = []
    for f in faults:
        hold = f" for {f.hold_s:g} s" if f.kind is FaultKind.DAEMON_STOP else ""
        lines.append(f"  #{f.index:<2} at {f.at_s:7.1f} s  {f.kind.value}{hold}")
    return "\n".join(lines)
