"""Engine start to HTTP-ready, and the idle engine's host memory, next to the weights' size.

Starts `kvengine serve` as a subprocess --reps times (the first run warms the page cache and the
on-disk kernel cache, CuPy's ``~/.cupy/kernel_cache``; the runs after it are the "warm" numbers
the target speaks of) and measures, from the spawn:

- `ready_s`: until `GET /health` answers 200 (the server is listening and the engine is loaded);
- `first_token_s`: until the first streamed token of a short request (kernels compiled or loaded
  from the cache, the first decode graphs captured);
- `idle_rss_bytes`: the engine process's resident host memory (VmRSS) after that request.

Target (H100, Qwen3-4B shape, warm page cache): ready <= 5 s. Writes JSON to benchmarks/results/.

    python -m benchmarks.startup --model DIR --device cuda [--reps 3] [--compile-bytecode]
    python -m benchmarks.startup --preset tiny --device cpu --reps 2     # smoke
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import command, machine_info, now_iso, today, write_result
from benchmarks.process_memory import host_memory
from kvstore.testing.processes import stop_process

TARGET_READY_S = 5.0


def _drain(stream, lines: list[str], timeline: list, start: float) -> None:
    for line in stream:
        lines.append(line)
        timeline.append((round(time.perf_counter() - start, 3), line.strip()[:160]))


# ``--profile``: the server under benchmarks.stack_sampler, its counts written at exit
_SAMPLED = ("import runpy, sys; import benchmarks.stack_sampler as s; s.install(sys.argv.pop(1), "
            "0.002); sys.argv[0] = 'server.cli'; runpy.run_module('server.cli', "
            "run_name='__main__')")


def one_start(model_dir: Path, device: str, extra: list[str], timeout_s: float,
              profile: Path | None = None) -> dict:
    """Spawn the server on a free port, time readiness and a first token, stop it. Every
    stderr line is kept with its time from the spawn (``timeline``): the phases of a start."""
    head = [sys.executable, "-m", "server.cli"] if profile is None else \
        [sys.executable, "-c", _SAMPLED, str(profile)]
    cmd = [*head, "serve", "--model", str(model_dir), "--device", device, "--port", "0", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    timeline: list[tuple[float, str]] = []
    url = None
    try:
        for line in proc.stderr:
            lines.append(line)
            timeline.append((round(time.perf_counter() - start, 3), line.strip()[:160]))
            if "listening on " in line:
                url = line.rsplit("listening on ", 1)[1].strip()
                break
            if time.perf_counter() - start > timeout_s:
                break
        threading.Thread(target=_drain, args=(proc.stderr, lines, timeline, start),
                         daemon=True).start()
        if url is None:
            raise RuntimeError("the server did not start:\n" + "".join(lines[-20:]))
        with httpx.Client(timeout=timeout_s) as client:
            while client.get(url + "/health").status_code != 200:
                time.sleep(0.01)
            ready_s = time.perf_counter() - start
            model = client.get(url + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "The store keeps blocks", "max_tokens": 8,
                    "stream": True, "temperature": 0.0}
            with client.stream("POST", url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                for chunk in response.iter_lines():
                    if chunk.startswith("data: ") and '"text"' in chunk:
                        break
            first_token_s = time.perf_counter() - start
        time.sleep(0.5)  # let the request finish so the RSS is the idle one
        rss = host_memory(proc.pid)["rss_bytes"]
    finally:
        stop_process(proc, timeout_s=60)
    load_line = next((ln.strip() for ln in lines if "model loaded in" in ln), None)
    return {"ready_s": round(ready_s, 3), "first_token_s": round(first_token_s, 3),
            "idle_rss_bytes": rss, "engine_log": load_line, "timeline": timeline}


def bytecode_state() -> dict:
    """Whether a start can read compiled bytecode (``pip install`` compiles what it installs;
    an image with PYTHONDONTWRITEBYTECODE=1 and no compiled files makes every start compile
    every module from source, about a second more): the interpreter's setting and whether the
    server's entry module and FastAPI have their ``.pyc``."""
    import importlib.util

    def compiled(module: str) -> bool | None:
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # its package is not installed (CuPy on a CPU machine)
            return None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None
        return Path(importlib.util.cache_from_source(spec.origin)).is_file()

    return {"dont_write_bytecode": sys.dont_write_bytecode,
            "server_cli_compiled": compiled("server.cli"),
            "fastapi_compiled": compiled("fastapi.routing"),
            "numpy_compiled": compiled("numpy._core.numeric"),
            "cupy_compiled": compiled("cupy._environment"),
            "cudnn_frontend_compiled": compiled("cudnn._pygraph")}


# what the server imports at start and in its warm-up (each one's folder is compiled)
_SERVER_MODULES = ("server.cli", "server.app", "engine.llm_engine", "kernels.cupy_ops",
                   "kernels.cudnn_attention", "cudnn", "cupy")


def compile_imported(modules: list[str]) -> tuple[int, int]:
    """Import ``modules`` (those that import here) and compile the folder of every module now
    loaded; (folders, folders compiled without an error). Run in a child: ``compile_bytecode``."""
    for name in modules:
        with contextlib.suppress(Exception):  # CuPy or cuDNN absent on a CPU machine
            importlib.import_module(name)
    folders = sorted({os.path.dirname(m.__file__) for m in list(sys.modules.values())
                      if (getattr(m, "__file__", None) or "").endswith(".py")})
    return len(folders), sum(bool(compileall.compile_dir(f, maxlevels=0, quiet=2))
                             for f in folders)


def compile_bytecode() -> dict:
    """What ``pip install`` does on a user's machine and an image with PYTHONDONTWRITEBYTECODE=1
    and wheels installed with --no-compile did not: compile the folder of every module the
    server imports (in a child process, which imports them). {"folders", "compiled", "seconds"}."""
    start = time.perf_counter()
    child = ("import sys; from benchmarks.startup import compile_imported; "
             "print(*compile_imported(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", child, *_SERVER_MODULES], check=True,
                         capture_output=True, text=True, timeout=600).stdout.split()
    return {"folders": int(out[0]), "compiled": int(out[1]),
            "seconds": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: make-model --preset)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--reps", type=int, default=3, help="starts; the first one warms up")
    parser.add_argument("--engine-args", default="", help="extra `kvengine serve` arguments")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--profile", type=Path, default=None, metavar="FILE",
                        help="one more start, under benchmarks.stack_sampler (counts to FILE; "
                             "not among the timed runs)")
    parser.add_argument("--compile-bytecode", action="store_true",
                        help="first compile the folder of every module the server imports, as "
                             "`pip install` does (for images that ship without bytecode)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.model:
        model_dir = Path(args.model)
    else:
        from engine.make_model import write_checkpoint

        model_dir = Path(tempfile.gettempdir()) / "kvengine" / f"{args.preset}-seed0"
        if not (model_dir / "config.json").exists():
            write_checkpoint(model_dir, args.preset, seed=0)
    weight_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    compiled = compile_bytecode() if args.compile_bytecode else None
    runs = [one_start(model_dir, args.device, args.engine_args.split(), args.timeout)
            for _ in range(max(args.reps, 2))]
    warm = runs[1:]
    if args.profile is not None:
        one_start(model_dir, args.device, args.engine_args.split(), args.timeout, args.profile)
    ready = statistics.median(r["ready_s"] for r in warm)
    report = {
        "benchmark": "startup", "model": str(model_dir), "device": args.device,
        "machine": machine_info(),
        "date": now_iso(utc=True),
        "command": command(f"{Path(sys.executable).name} -m benchmarks.startup", argv),
        "weight_bytes": weight_bytes, "bytecode": bytecode_state(),
        "compiled_before_the_runs": compiled, "runs": runs,
        "warm": {"ready_s_median": ready,
                 "first_token_s_median": statistics.median(r["first_token_s"] for r in warm),
                 "idle_rss_bytes_median": statistics.median(r["idle_rss_bytes"] for r in warm)},
        "target": {"ready_s": TARGET_READY_S, "met": ready <= TARGET_READY_S},
    }
    print(json.dumps(report, indent=2))
    tag = "cpu" if args.device == "cpu" else (report["machine"].get("gpu") or "gpu").split()[1]
    path = write_result(args.out, f"startup-{model_dir.name}-{tag.lower()}-{today()}.json", report)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
