"""A real vLLM engine with the kvstore connector in its own process (``vllm_child.py``), for
tests and benchmarks: start it, ask it for prompts, stop it."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from kvstore.testing.processes import stop_process

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # where ``offload.vllm_connector`` is found
CHILD = Path(__file__).with_name("vllm_child.py")


class VllmProcess:
    """One vLLM engine in its own process; ``ask`` sends a prompt and returns its result."""

    def __init__(self, model_dir: Path, socket_path: Path | None, extra: dict | None = None,
                 wait: bool = True, engine_args: dict | None = None,
                 env: dict[str, str] | None = None) -> None:
        """``extra``: the connector's ``kv_connector_extra_config``; ``engine_args``: vLLM
        ``LLM`` arguments over the child's defaults (``tensor_parallel_size``...); ``env``:
        variables for the child on top of this process's."""
        path = os.pathsep.join([str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {}),
               "PYTHONPATH": path}
        env.pop("KVSTORE_SOCKET", None)
        # READY and RESULT lines come on a pipe of their own: on the shared stdout/stderr, a
        # log line from another thread of the child can land inside a RESULT line.
        result_r, result_w = os.pipe()
        args = [sys.executable, str(CHILD), str(model_dir),
                str(socket_path) if socket_path is not None else "-", json.dumps(extra or {}),
                str(result_w), json.dumps(engine_args or {})]
        try:
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, cwd=SOURCE_ROOT,
                                         env=env, pass_fds=(result_w,))
        except BaseException:
            os.close(result_r)
            raise
        finally:
            os.close(result_w)
        self.lines: list[str] = []
        self._results: queue.Queue = queue.Queue()
        self._ready = threading.Event()  # READY seen, or the results pipe ended
        self._saw_ready = False
        threading.Thread(target=self._pump_log, daemon=True).start()
        threading.Thread(target=self._pump_results, args=(os.fdopen(result_r, "r"),),
                         daemon=True).start()
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = 300.0) -> VllmProcess:
        """Block until the engine is up (start several first, then wait: they overlap)."""
        if (not self._ready.wait(timeout_s) or not self._saw_ready
                or self.proc.poll() is not None):
            self.stop()
            raise RuntimeError("vLLM did not start:\n" + self.tail())
        return self

    def _pump_log(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _pump_results(self, results) -> None:
        """READY, then one RESULT per request; a line that is neither is passed on as an error
        (``ask`` raises it), never a dead thread and a caller waiting out its timeout."""
        with results:
            for line in results:
                line = line.rstrip("\n")
                if line == "READY":
                    self._saw_ready = True
                    self._ready.set()
                    continue
                try:
                    if not line.startswith("RESULT "):
                        raise ValueError("neither READY nor RESULT")
                    self._results.put(json.loads(line[len("RESULT "):]))
                except ValueError as exc:
                    self._results.put(RuntimeError(f"unreadable result line ({exc}): "
                                                   f"{line[:200]!r}"))
        self._results.put(None)
        self._ready.set()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def ask(self, prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
            max_tokens: int = 4, timeout_s: float = 120.0,
            batch: list[list[int]] | None = None) -> dict:
        """One prompt's result; or, with ``batch`` instead, the prompts run together (each
        one's in ``outputs``, in order)."""
        if (prompt_token_ids is None) == (batch is None) or batch == []:
            raise ValueError("ask takes one prompt or a non-empty batch")
        return self._request({"prompt_token_ids": prompt_token_ids, "batch": batch,
                              "cache_salt": cache_salt, "max_tokens": max_tokens}, timeout_s)

    def reset_prefix_cache(self, reset_connector: bool, timeout_s: float = 60.0) -> bool:
        """``LLM.reset_prefix_cache(reset_connector=...)`` in the child (vLLM's
        ``/reset_prefix_cache``); its answer."""
        return self._request({"reset_prefix_cache": {"reset_connector": reset_connector}},
                             timeout_s)["reset"]

    def _request(self, request: dict, timeout_s: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        try:
            result = self._results.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"vLLM gave no answer in {timeout_s} s:\n{self.tail()}") from None
        if result is None:
            raise RuntimeError(f"vLLM exited:\n{self.tail()}")
        if isinstance(result, Exception):
            raise result
        return result

    def stop(self) -> None:
        """Close its stdin (the child ends after the request in hand), wait, then kill."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
        stop_process(self.proc, None, timeout_s=30)
