"""Where a process's threads spend their time: stacks sampled every ``interval_s``, counted.

Installed in a ``kvstore serve`` process by a benchmark's ``--profile`` preamble
(``import benchmarks.stack_sampler as ss; ss.install(PATH)``): a thread reads every other
thread's Python stack (``sys._current_frames``) and counts each distinct stack (innermost
frames last, file:line:function); at exit it writes the counts, most frequent first, as JSON.
Idle threads (blocked in ``select``, ``queue.get``, ...) are sampled too: read a stack's count
against the samples of its thread. A time spent inside a C call (a CUDA synchronize, a socket
send) shows as the Python frame that made it. A benchmark only: the daemon never imports it.
"""

from __future__ import annotations

import atexit
import collections
import json
import sys
import threading
import time

_DEPTH = 14


def _stack(frame) -> str:
    parts = []
    while frame is not None and len(parts) < _DEPTH:
        code = frame.f_code
        parts.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}:{code.co_name}")
        frame = frame.f_back
    return " < ".join(parts)


def install(path: str, interval_s: float = 0.0002) -> None:
    """Sample every thread of this process until exit; write the counts to ``path``."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    per_thread: collections.Counter[str] = collections.Counter()
    stop = threading.Event()

    def sample() -> None:
        me = threading.get_ident()
        while not stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                per_thread[name] += 1
                counts[(name, _stack(frame))] += 1
            time.sleep(interval_s)

    def write() -> None:
        stop.set()
        top = [{"thread": t, "samples": n, "stack": s} for (t, s), n in counts.most_common(300)]
        with open(path, "w") as f:
            json.dump({"interval_s": interval_s, "per_thread": dict(per_thread), "top": top},
                      f, indent=1)

    sys.setswitchinterval(0.001)  # a busy thread yields the GIL to the sampler sooner
    threading.Thread(target=sample, name="stack-sampler", daemon=True).start()
    atexit.register(write)
