"""A real `kvengine serve` process on a tiny CPU model for the HTTP attack tests, and a watch on
its /health while they run."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from support.kvengine import KvengineProcess

from engine.make_model import write_checkpoint


def tiny_model(folder: Path) -> Path:
    """A tiny random-weight model folder (written once per folder)."""
    if not (folder / "config.json").is_file():
        write_checkpoint(folder, "tiny", seed=0)
    return folder


class EngineProcess(KvengineProcess):
    """`kvengine serve --model MODEL --num-kv-blocks 128 *args` on CPU, started and listening
    (``KvengineProcess`` with the attack tests' model and arena)."""

    def __init__(self, model_dir: Path, *args: str, **kwargs) -> None:
        super().__init__("--model", str(model_dir), "--num-kv-blocks", "128", *args, **kwargs)


class HealthWatch:
    """Polls /health from a thread with fresh connections; `worst_s` is the longest wait."""

    def __init__(self, url: str, interval_s: float = 0.05, timeout_s: float = 60.0) -> None:
        self._url = url
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self.waits_s: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self._timeout_s + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                status = httpx.get(self._url + "/health", timeout=self._timeout_s).status_code
                if status != 200:
                    self.failures.append(f"status {status}")
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
            self.waits_s.append(time.perf_counter() - start)
            self._stop.wait(self._interval_s)

    @property
    def worst_s(self) -> float:
        return max(self.waits_s, default=0.0)


def post_all_while_watching(url: str, path: str, bodies: list[dict[str, Any]]
                            ) -> tuple[list[httpx.Response], float, HealthWatch]:
    """POST every body to ``url + path`` at once while /health is polled every 20 ms:
    (responses, seconds, the watch), the watch asserted free of failures. Bodies are encoded
    first: the watch's thread must not wait for this process's GIL."""
    responses: list[httpx.Response] = []
    encoded = [json.dumps(body).encode() for body in bodies]

    def send(content: bytes) -> None:
        responses.append(httpx.post(url + path, content=content, timeout=60,
                                    headers={"Content-Type": "application/json"}))

    senders = [threading.Thread(target=send, args=(content,)) for content in encoded]
    with HealthWatch(url, interval_s=0.02) as watch:
        time.sleep(0.1)  # the watch is polling before the attack starts
        start = time.perf_counter()
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        took_s = time.perf_counter() - start
        time.sleep(0.1)
    assert len(responses) == len(bodies)
    assert not watch.failures, watch.failures[:3]
    return responses, took_s, watch
