"""Where a process's threads spend their time: stacks sampled every ``interval_s``, counted.

Installed in a ``kvstore serve`` process by a benchmark's ``--profile`` preamble
(``import benchmarks.stack_sampler as ss; ss.install(PATH)``): a thread reads every other
thread's Python stack (``sys._current_frames``) and counts each distinct stack (innermost
frames last, file:line:function); at exit it writes the counts, most frequent first, as JSON.
Idle threads (blocked in ``select``, ``queue.get``, ...) are sampled too: read a stack's count
against the samples of its thread. A time spent inside a C call (a CUDA synchronize, a socket
send) shows as the Python frame that made it. A deep stack keeps its innermost frames and its
outermost ones (what called it: an import inside the engine's start is still placed). The main
thread's ``timeline`` names its most frequent stack in each tenth of a second since install, to
tell phases apart (imports, weights, warm-up). A benchmark only: the daemon never imports it.
"""

from __future__ import annotations

import atexit
import collections
import json
import sys
import threading
import time

_INNER, _OUTER = 10, 5  # frames kept at each end of a deep stack
_TOP_STACKS = 2000
_TIMELINE_S = 0.1


def _stack(frame) -> str:
    parts = []
    while frame is not None:
        code = frame.f_code
        parts.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}:{code.co_name}")
        frame = frame.f_back
    if len(parts) > _INNER + _OUTER:
        parts = [*parts[:_INNER], "...", *parts[-_OUTER:]]
    return " < ".join(parts)


def install(path: str, interval_s: float = 0.0002) -> None:
    """Sample every thread of this process until exit; write the counts to ``path``."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    per_thread: collections.Counter[str] = collections.Counter()
    timeline: collections.defaultdict[int, collections.Counter[str]] = \
        collections.defaultdict(collections.Counter)
    main_ident = threading.main_thread().ident
    started = time.perf_counter()
    stop = threading.Event()

    def sample() -> None:
        me = threading.get_ident()
        while not stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                stack = _stack(frame)
                per_thread[name] += 1
                counts[(name, stack)] += 1
                if ident == main_ident:
                    timeline[int((time.perf_counter() - started) / _TIMELINE_S)][stack] += 1
            time.sleep(interval_s)

    def write() -> None:
        stop.set()
        sampler.join(1.0)  # no sample is being counted while the counts are read
        top = [{"thread": t, "samples": n, "stack": s}
               for (t, s), n in counts.most_common(_TOP_STACKS)]
        main = [{"at_s": round(i * _TIMELINE_S, 1), "samples": sum(c.values()),
                 "stack": c.most_common(1)[0][0]} for i, c in sorted(timeline.items())]
        with open(path, "w") as f:
            json.dump({"interval_s": interval_s, "per_thread": dict(per_thread), "top": top,
                       "timeline": main}, f, indent=1)

    sys.setswitchinterval(0.001)  # a busy thread yields the GIL to the sampler sooner
    sampler = threading.Thread(target=sample, name="stack-sampler", daemon=True)
    sampler.start()
    atexit.register(write)
