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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

import engine as engine_package
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import resolve_device
from engine.make_model import write_checkpoint
from kvstore.cli.args import OneLineParser, positive_int_arg

_DATA = Path(engine_package.__file__).resolve().parent / "data"  # text the package ships

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


@dataclass(frozen=True)
class DemoShape:
    """How big the tour is: small on CPU; on a GPU, histories of several thousand tokens and an
    HBM arena that holds about one user's context, so users push each other out."""

    preset: str
    num_kv_blocks: int
    max_model_len: int
    system_tokens: int  # the shared system prompt
    document_tokens: int  # each user's own document, pasted in their first turn
    answer_tokens: int
    dram: str  # the embedded daemon's DRAM tier


CPU_SHAPE = DemoShape("tiny", num_kv_blocks=48, max_model_len=768, system_tokens=0,
                      document_tokens=0, answer_tokens=24, dram="256MiB")
GPU_SHAPE = DemoShape("qwen3-0.6b", num_kv_blocks=512, max_model_len=8192, system_tokens=4000,
                      document_tokens=3000, answer_tokens=32, dram="4GiB")


def _model_dir(preset: str, cache_dir: Path) -> Path:
    model_dir = cache_dir / preset
    if not (model_dir / "config.json").exists():
        print(f"writing a random-weight {preset} checkpoint to {model_dir} (once)...", flush=True)
        tmp = cache_dir / f".{preset}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        write_checkpoint(tmp, preset, seed=0)
        tmp.rename(model_dir)
    else:
        print(f"model: {model_dir} (a random-weight {preset} checkpoint written by an earlier "
              "run; delete it to write it again)", flush=True)
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


def _corpus_text(tok, num_tokens: int, offset: int) -> str:
    """About ``num_tokens`` tokens of the text the package ships, starting ``offset`` characters
    in, so that every user's document differs."""
    if num_tokens <= 0:
        return ""
    corpus = " ".join((_DATA / name).read_text() for name in ("stories.txt", "facts.txt"))
    text = corpus[offset % len(corpus):] + " " + corpus
    ids = tok.encode(text[: num_tokens * 8], add_special_tokens=False)[:num_tokens]
    return tok.decode(ids)


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``kvstore demo``."""
    summary = __doc__.splitlines()[0].replace("``", "")  # plain text in --help, not RST
    parser = OneLineParser(prog="kvstore demo", description=summary)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the engine runs; auto takes the GPU when CuPy sees one")
    parser.add_argument("--preset", default=None,
                        help="make-model preset (default: tiny on CPU, qwen3-0.6b on a GPU)")
    parser.add_argument("--users", type=positive_int_arg, default=3, help="users taking turns")
    parser.add_argument("--turns", type=positive_int_arg, default=4, help="turns per user")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/kvstore/models"),
                        help="where the random-weight model is written once and reused")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the tour; the exit status of ``kvstore demo``."""
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    shape = GPU_SHAPE if device == "cuda" else CPU_SHAPE
    if args.preset:
        shape = replace(shape, preset=args.preset)
    cache_dir = Path(args.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(shape.preset, cache_dir)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-demo-"))
    daemon, socket_path = start_embedded_daemon(workdir, dram=shape.dram)
    print(f"embedded daemon on {socket_path} ({shape.dram} DRAM, 256 MiB SSD); model "
          f"{shape.preset} on {device}", flush=True)
    try:
        return _tour(model_dir, device, socket_path, shape, args.users, args.turns)
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(workdir, ignore_errors=True)


def _warm_up(engines: list[LLMEngine], tok, shape: DemoShape, params: SamplingParams) -> float:
    """Compile kernels, capture graphs and grow the device memory pool before anything is timed:
    a cold prompt longer than any the tour sends, a long prefill over a cached prefix, short
    steps over a cached prefix (one per bucket of query rows) and (offload on) a restore from the
    store; seconds taken."""
    started = time.perf_counter()
    num_tokens = shape.max_model_len - 2 * shape.answer_tokens
    long_ids = tok.encode(_corpus_text(tok, num_tokens, offset=7919))[:num_tokens]
    other_ids = tok.encode(_corpus_text(tok, num_tokens, offset=104729))
    partial_ids = (long_ids[: len(long_ids) // 4] + other_ids)[:num_tokens]
    for n, engine in enumerate(engines):
        _ttft(engine, f"warm-{n}-cold", long_ids, params)
        _ttft(engine, f"warm-{n}-partial", partial_ids, params)
        _ttft(engine, f"warm-{n}-hit", long_ids[:-8] + tok.encode(" Why?"), params)
        # a turn computes a few dozen tokens over its cached history: the short prefill (and
        # decode) graphs, with the cuDNN graphs they use, as `kvengine serve` builds them
        engine.warm_up()
        if engine.config.kv_offload:
            engine.offload.wait_idle()
            engine.reset_prefix_cache()  # the next hit comes from the store
            _ttft(engine, f"warm-{n}-restore", long_ids[:-8] + tok.encode(" How?"), params)
    return time.perf_counter() - started


def _tour(model_dir: Path, device: str, socket_path: Path, shape: DemoShape, num_users: int,
          num_turns: int) -> int:
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=shape.answer_tokens, ignore_eos=True)
    config = dict(model_dir=str(model_dir), device=device, num_kv_blocks=shape.num_kv_blocks,
                  max_model_len=shape.max_model_len, kv_store_socket=str(socket_path))
    engine = LLMEngine(EngineConfig(kv_offload=True, **config))
    cold = LLMEngine(EngineConfig(kv_offload=False, enable_prefix_caching=False, **config))
    tok = engine.tokenizer
    if device == "cuda":
        print(f"warm-up (kernel compilation, CUDA graphs): "
              f"{_warm_up([engine, cold], tok, shape, params):.1f} s", flush=True)
    system = _corpus_text(tok, shape.system_tokens, offset=0) or _SYSTEM * 6
    histories = [[{"role": "system", "content": system}] for _ in range(num_users)]
    documents = [_corpus_text(tok, shape.document_tokens, offset=50021 * (u + 1))
                 for u in range(num_users)]
    rows = []
    graphs_built = 0  # attention graphs built inside cached turns

    def turn(eng: LLMEngine, user: int, label: str) -> None:
        nonlocal graphs_built
        text = tok.apply_chat_template(histories[user], add_generation_prompt=True)
        ids = tok.encode(text)
        # A user's think time: the previous turn's write-through saves finish first, as they
        # would between real turns (on a GPU the daemon's copies share the device).
        eng.offload.wait_idle()
        graphs_before = eng.runner.ops.num_attention_graphs
        ttft, out = _ttft(eng, f"{label}-u{user}-{len(rows)}", ids, params)
        if out.num_cached_tokens:  # a build inside a timed cached turn: the warm-up missed it
            graphs_built += eng.runner.ops.num_attention_graphs - graphs_before
        cold_ttft, _ = _ttft(cold, f"cold-{len(rows)}", ids, params)
        rows.append((label, user, len(ids), out.num_cached_tokens, _served_from(out), ttft,
                     cold_ttft))
        return out

    for t in range(num_turns):
        for user in range(num_users):
            question = _QUESTIONS[int(rng.integers(len(_QUESTIONS)))]
            if t == 0 and documents[user]:
                question = f"Here is my document:\n{documents[user]}\n\n{question}"
            histories[user].append({"role": "user", "content": f"(turn {t + 1}) {question}"})
            out = turn(engine, user, f"turn {t + 1}")
            histories[user].append({"role": "assistant", "content": out.text or "..."})
    engine.offload.wait_idle()
    engine.close()
    restarted = LLMEngine(EngineConfig(kv_offload=True, **config))
    if device == "cuda":
        print(f"restarted engine warm-up: {_warm_up([restarted], tok, shape, params):.1f} s",
              flush=True)
    for user in range(num_users):
        histories[user].append({"role": "user", "content": "Summarize our chat."})
        turn(restarted, user, "restart")
    store = restarted.stats()["kv_offload"]
    restarted.close()
    cold.close()
    _print_table(rows)
    print(f"\nattention graphs built inside cached turns: {graphs_built} (a first-use build "
          "costs ~0.1 s; the warm-up builds every shape a turn uses)")
    print(f"\nengine side: {store.get('blocks_loaded', 0)} blocks restored, "
          f"{store.get('blocks_saved', 0)} saved, "
          f"{store.get('evictions_published', 0)} evictions published")
    return 0


def _print_table(rows: list[tuple]) -> None:
    """One row per turn, then the headline: cached turns against cold prefills, same run."""
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
              f"{mean_cold * 1e3:.1f} ms for a cold prefill of the same prompts, same run "
              f"({mean_cold / mean_warm:.1f}x)")


if __name__ == "__main__":
    raise SystemExit(main())
