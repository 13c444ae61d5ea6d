"""``kvstore demo``: an embedded daemon, an engine with --kv-offload, and a multi-turn chat.

Several users chat in turns over a shared system prompt; the engine's KV arena is kept small on
purpose, so a user's history is pushed out of HBM while the others talk and comes back from the
store's DRAM tier on their next turn. Then the engine restarts and every user's last turn is served
again from the store. A table shows each turn's TTFT and the tier its cached tokens came from,
next to a cold prefill of the same prompt.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import resolve_device
from engine.make_model import write_checkpoint

_SYSTEM = ("You are a careful assistant for a team that runs a tiered cache for language models. "
           "Answer briefly, cite the tier that served each request, and keep the history in mind. ")
_QUESTIONS = ["How do blocks move from HBM to DRAM?", "What happens on an SSD checksum miss?",
              "Why are hits verified instead of trusted?", "How is a lease released?",
              "What does the restore policy compare?", "Where do evicted blocks go?"]


def start_embedded_daemon(workdir: Path, dram: str = "256MiB", ssd: str = "256MiB",
                          timeout_s: float = 60.0) -> tuple[subprocess.Popen, Path]:
    """Start `kvstore serve` on a socket and SSD dir under ``workdir``; (process, socket path).

    Its output is read until it says ready, then drained on a thread so the pipe never fills.
    """
    socket_path = workdir / "kvstore.sock"
    ssd_dir = workdir / "ssd"
    ssd_dir.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--socket", str(socket_path),
           "--dram", dram, "--ssd-dir", str(ssd_dir), "--ssd-size", ssd, "--http", "off"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        lines.append(line.rstrip())
        if "kvstore: ready" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, socket_path
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("the embedded daemon did not start:\n" + "\n".join(lines))


def _model_dir(preset: str, cache_dir: Path) -> Path:
    model_dir = cache_dir / preset
    if not (model_dir / "config.json").exists():
        print(f"writing a random-weight {preset} checkpoint to {model_dir} (once)...", flush=True)
        tmp = cache_dir / f".{preset}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        write_checkpoint(tmp, preset, seed=0)
        tmp.rename(model_dir)
    return model_dir


def _ttft(engine: LLMEngine, request_id: str, prompt_ids: list[int],
          params: SamplingParams) -> tuple[float, object]:
    """Time to the first token, then run the request to its end; (ttft_s, final output)."""
    started = time.perf_counter()
    engine.add_request(request_id, prompt_ids, params)
    ttft, final = None, None
    while final is None:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if ttft is None and out.token_ids:
                ttft = time.perf_counter() - started
            if out.finished:
                final = out
    return ttft or 0.0, final


def _served_from(out) -> str:
    tiers = {t: n for t, n in out.cached_tokens_by_tier.items() if n}
    return "+".join(f"{t}:{n}" for t, n in tiers.items()) if tiers else "cold"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore demo", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--preset", default=None,
                        help="make-model preset (default: tiny on CPU, qwen3-0.6b on a GPU)")
    parser.add_argument("--users", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/kvstore/models"))
    args = parser.parse_args(argv)
    if args.users < 1 or args.turns < 1:
        parser.error("--users and --turns must be at least 1")
    device = resolve_device(args.device)
    preset = args.preset or ("qwen3-0.6b" if device == "cuda" else "tiny")
    cache_dir = Path(args.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(preset, cache_dir)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-demo-"))
    daemon, socket_path = start_embedded_daemon(workdir)
    print(f"embedded daemon on {socket_path} (256 MiB DRAM, 256 MiB SSD); model {preset} on "
          f"{device}", flush=True)
    try:
        return _tour(model_dir, device, socket_path, args.users, args.turns)
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(workdir, ignore_errors=True)


def _tour(model_dir: Path, device: str, socket_path: Path, num_users: int, num_turns: int) -> int:
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # Small on purpose: about one user's history fits, so the others' are pushed to the store.
    config = dict(model_dir=str(model_dir), device=device, num_kv_blocks=48,
                  max_model_len=768, kv_store_socket=str(socket_path))
    engine = LLMEngine(EngineConfig(kv_offload=True, **config))
    cold = LLMEngine(EngineConfig(kv_offload=False, enable_prefix_caching=False, **config))
    tok = engine.tokenizer
    system = _SYSTEM * 6
    histories = [[{"role": "system", "content": system}] for _ in range(num_users)]
    rows = []

    def turn(eng: LLMEngine, user: int, label: str) -> None:
        text = tok.apply_chat_template(histories[user], add_generation_prompt=True)
        ids = tok.encode(text)
        ttft, out = _ttft(eng, f"{label}-u{user}-{len(rows)}", ids, params)
        cold_ttft, _ = _ttft(cold, f"cold-{len(rows)}", ids, params)
        rows.append((label, user, len(ids), out.num_cached_tokens, _served_from(out), ttft,
                     cold_ttft))
        return out

    for t in range(num_turns):
        for user in range(num_users):
            question = _QUESTIONS[int(rng.integers(len(_QUESTIONS)))]
            histories[user].append({"role": "user", "content": f"(turn {t + 1}) {question}"})
            out = turn(engine, user, f"turn {t + 1}")
            histories[user].append({"role": "assistant", "content": out.text or "..."})
    engine.offload.wait_idle()
    engine.close()
    restarted = LLMEngine(EngineConfig(kv_offload=True, **config))
    for user in range(num_users):
        histories[user].append({"role": "user", "content": "Summarize our chat."})
        turn(restarted, user, "restart")
    store = restarted.stats()["kv_offload"]
    restarted.close()
    cold.close()
    _print_table(rows)
    print(f"\nengine side: {store.get('blocks_loaded', 0)} blocks restored, "
          f"{store.get('blocks_saved', 0)} saved, "
          f"{store.get('evictions_published', 0)} evictions published")
    return 0


def _print_table(rows: list[tuple]) -> None:
    print(f"\n{'turn':>9} {'user':>4} {'prompt':>6} {'cached':>6}  {'served from':<22}"
          f" {'TTFT ms':>8} {'cold ms':>8} {'speedup':>7}")
    for label, user, num_prompt, num_cached, served, ttft, cold in rows:
        speedup = cold / ttft if ttft > 0 else float("nan")
        print(f"{label:>9} {user:>4} {num_prompt:>6} {num_cached:>6}  {served:<22}"
              f" {ttft * 1e3:>8.1f} {cold * 1e3:>8.1f} {speedup:>6.1f}x")
    warm = [r for r in rows if r[3] > 0]
    if warm:
        mean_warm = sum(r[5] for r in warm) / len(warm)
        mean_cold = sum(r[6] for r in warm) / len(warm)
        print(f"\nturns with a cached prefix: mean TTFT {mean_warm * 1e3:.1f} ms against "
              f"{mean_cold * 1e3:.1f} ms cold ({mean_cold / mean_warm:.1f}x)")


if __name__ == "__main__":
    raise SystemExit(main())
