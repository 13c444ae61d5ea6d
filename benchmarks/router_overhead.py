"""The router's own cost (issue 28): TTFT through ``kvengine router --routing kv`` against TTFT of
the same request sent straight to the engine the router picks.

One ``kvstore serve``, N ``kvengine serve --kv-offload`` (``cuda:0``..``cuda:N-1``, or N CPU
engines), the router in front. Prompts of each size (``--sizes``, tokens), completions and chats,
streamed, are computed on the engines in turn (whose HBM then holds them) and routed there, then
per size each is sent ``--reps`` times to its engine and ``--reps`` times through the router, in
one random order: both are HBM hits on the same engine, so the difference is the router's work
(body parsed, prompt rendered and tokenized, chain hashed, the daemon's ``locate``, the proxy
hop). The router's ``x-kvengine-engine`` header names the engine that served; a routed request
that went elsewhere is counted, not compared. TTFT: to the first event with generated text.
A third path measures the floor: the same request through a bare ``kvengine router --routing
round-robin`` in front of that one engine (the router's HTTP server, middleware and proxy, no
prompt, chain or daemon), so the routing decision's own share (kv minus bare) stands apart
from what any Python HTTP hop costs (bare minus direct).

Per size: TTFT p50/p90 both ways and the added ms (target: <= 2 at p50), the paired differences,
the router's timings from its /metrics (``kvengine:router_route_seconds``, ``_prompt_seconds``,
``_kv_locate_seconds``: mean, p50, p90 from the buckets), its CPU per routed request beyond its
idle probing, its requests by reason (a ``fallback`` is a locate past its bound) and the load
average: where the same cores run the engines and the daemon, waits for a core are in every
number. JSON to ``--out``.

    python -m benchmarks.router_overhead --model-dir DIR --device cuda --engines 2
    kvengine make-model --preset small --out /tmp/small      # 8k positions: 4,000-token prompts
    python -m benchmarks.router_overhead --model-dir /tmp/small --device cpu --reps 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.common import command, machine_info, now_iso, percentile, today, write_result
from benchmarks.router_metrics import metrics_delta, router_metrics
from benchmarks.servers import ServerProcess
from benchmarks.sizing import model_shape, tokens_per_word_of
from benchmarks.workload import words_text
from server.router.proxy import ENGINE_HEADER

TARGET_ADDED_P50_MS = 2.0
KINDS = ("completion", "chat")
_PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class Prompt:
    """One request body, sent both ways, and the engine that holds its prefix."""

    name: str
    kind: str
    size: int  # asked-for tokens
    body: bytes
    engine: str = ""  # the engine that computed it when warmed, and holds it
    num_tokens: int = 0  # the engine's count


def _prompts(args: argparse.Namespace, tokens_per_word: float) -> list[Prompt]:
    out = []
    for size in args.sizes:
        for kind in KINDS:
            for i in range(args.prompts_per_size):
                text = words_text(random.Random(f"{kind}:{size}:{i}:{args.seed}"), size,
                                  tokens_per_word)
                body: dict = {"max_tokens": args.max_tokens, "temperature": 0.0,
                              "ignore_eos": True, "stream": True,
                              "stream_options": {"include_usage": True}}
                if kind == "chat":
                    body["messages"] = [{"role": "user", "content": text}]
                else:
                    body["prompt"] = text
                out.append(Prompt(f"{kind}-{size}-{i}", kind, size, json.dumps(body).encode()))
    return out


def send(client: httpx.Client, url: str, prompt: Prompt) -> dict:
    """One streamed request: ms to the first byte and to the first generated text, the engine
    header, the usage; ``error`` when it failed."""
    sent = time.perf_counter()
    out: dict = {"error": None, "first_byte_ms": None, "ttft_ms": None, "usage": None}
    with client.stream("POST", url + _PATHS[prompt.kind], content=prompt.body,
                       headers={"content-type": "application/json"}) as response:
        out["engine"] = response.headers.get(ENGINE_HEADER)
        if response.status_code != 200:
            response.read()
            out["error"] = f"{response.status_code}: {response.text[:300]}"
            return out
        for line in response.iter_lines():
            now = time.perf_counter()
            if out["first_byte_ms"] is None:
                out["first_byte_ms"] = (now - sent) * 1e3
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choice = (event.get("choices") or [{}])[0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text and out["ttft_ms"] is None:
                out["ttft_ms"] = (now - sent) * 1e3
            if event.get("usage"):
                out["usage"] = event["usage"]
    if out["ttft_ms"] is None:
        out["error"] = "no generated text in the stream"
    return out


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a process has used; None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stats(values: list[float]) -> dict:
    return {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9), "n": len(values)}


def summarize(trials: list[dict], prompts: dict[str, Prompt]) -> dict:
    """Direct and routed TTFT (and first byte), their p50/p90 and differences, paired
    differences (the k-th routed against the k-th direct of the same prompt)."""
    ok = [t for t in trials if t["error"] is None and not t.get("elsewhere")]
    out: dict = {}

    def minus(a: dict, b: dict, q: str) -> float | None:
        return a[q] - b[q] if a[q] is not None and b[q] is not None else None

    for key in ("ttft_ms", "first_byte_ms"):
        d, r, h = (_stats([t[key] for t in ok if t["path"] == path])
                   for path in ("direct", "routed", "hop"))
        out[key] = {"direct": d, "routed": r, "hop": h,
                    "added_p50_ms": minus(r, d, "p50"), "added_p90_ms": minus(r, d, "p90"),
                    "hop_added_p50_ms": minus(h, d, "p50"),
                    "routing_added_p50_ms": minus(r, h, "p50")}
    paired = []
    for name in prompts:
        direct = [t["ttft_ms"] for t in ok if t["prompt"] == name and t["path"] == "direct"]
        routed = [t["ttft_ms"] for t in ok if t["prompt"] == name and t["path"] == "routed"]
        paired += [r - d for r, d in zip(routed, direct)]
    out["paired_added_ms"] = _stats(paired)
    out["num_errors"] = sum(t["error"] is not None for t in trials)
    out["num_routed_elsewhere"] = sum(bool(t.get("elsewhere")) for t in trials)
    out["min_hbm_share"] = min((t["hbm_share"] for t in ok if t.get("hbm_share") is not None),
                               default=None)
    return out


def _hbm_share(usage: dict | None, block_size: int) -> float | None:
    """Cached HBM tokens over the full blocks a hit can cover (1.0: a whole HBM hit)."""
    if not usage:
        return None
    full = (usage["prompt_tokens"] - 1) // block_size * block_size
    by_tier = (usage.get("prompt_tokens_details") or {}).get("cached_tokens_by_tier") or {}
    return by_tier.get("hbm", 0) / full if full else None


def warm(client: httpx.Client, router_url: str, engine_urls: list[str], prompts: list[Prompt],
         tries: int) -> None:
    """Each prompt computed on one engine (in turn), then sent through the router until it
    lands there twice in a row (the blocks published, the daemon asked); a prompt the router
    keeps sending elsewhere (an engine it saw down meanwhile computed it too) is reported."""
    for i, prompt in enumerate(prompts):
        prompt.engine = engine_urls[i % len(engine_urls)]
        first = send(client, prompt.engine, prompt)
        if first["error"]:
            raise RuntimeError(f"{prompt.name}: {first['error']}")
        prompt.num_tokens = first["usage"]["prompt_tokens"]
        time.sleep(0.3)  # published to the daemon before the router asks it
        landed: list[str] = []
        while len(landed) < tries and landed[-2:] != [prompt.engine] * 2:
            landed.append(send(client, router_url, prompt)["engine"])
        if landed[-2:] != [prompt.engine] * 2:
            print(f"{prompt.name}: the router sends it elsewhere than {prompt.engine}: {landed}",
                  file=sys.stderr)


def measure(client: httpx.Client, router_url: str, prompts: list[Prompt], reps: int,
            rng: random.Random, gap_s: float, block_size: int,
            hops: dict[str, str]) -> list[dict]:
    """``reps`` direct, ``reps`` routed and ``reps`` bare-hop sends of each prompt (``hops``:
    the bare router in front of each engine), in one random order."""
    paths = ("direct", "routed", "hop")
    order = [(p, path) for p in prompts for path in paths for _ in range(reps)]
    rng.shuffle(order)
    trials = []
    for prompt, path in order:
        url = {"direct": prompt.engine, "routed": router_url}.get(path) or hops[prompt.engine]
        result = send(client, url, prompt)
        trials.append({"prompt": prompt.name, "path": path, "error": result["error"],
                       "ttft_ms": result["ttft_ms"], "first_byte_ms": result["first_byte_ms"],
                       "elsewhere": path == "routed" and result["engine"] != prompt.engine,
                       "hbm_share": _hbm_share(result["usage"], block_size)})
        time.sleep(gap_s)  # the engine's saves after a request stay out of the next one
    return trials


def measure_size(client: httpx.Client, router_url: str, router_pid: int, group: list[Prompt],
                 args: argparse.Namespace, rng: random.Random, hops: dict[str, str]) -> dict:
    """One size's prompts measured both ways: the summary, the router's own figures (its
    timings and reasons from /metrics, its CPU per routed request beyond its idle rate), each
    trial."""
    cpu = [cpu_s(router_pid)]  # idle for 3 s (its probes of the engines), then measured
    time.sleep(3.0)
    load_before, before = os.getloadavg(), router_metrics(router_url)
    cpu.append(cpu_s(router_pid))
    start = time.perf_counter()
    trials = measure(client, router_url, group, args.reps, rng, args.gap_ms / 1e3,
                     args.block_size, hops)
    elapsed, router = time.perf_counter() - start, metrics_delta(before,
                                                                 router_metrics(router_url))
    cpu.append(cpu_s(router_pid))
    num_routed = sum(t["path"] == "routed" for t in trials)
    router["cpu_ms_per_request"] = None if None in cpu else \
        (cpu[2] - cpu[1] - (cpu[1] - cpu[0]) / 3.0 * elapsed) / num_routed * 1e3  # its own
    named = {p.name: p for p in group}
    return {"load_average_1m": [load_before[0], os.getloadavg()[0]],
            "prompt_tokens": {p.name: p.num_tokens for p in group},
            "engines": {p.name: p.engine for p in group}, **summarize(trials, named),
            "router": router,
            "by_kind": {kind: summarize([t for t in trials if named[t["prompt"]].kind == kind],
                                        named) for kind in KINDS},
            "trials": [{k: t[k] for k in ("prompt", "path", "ttft_ms", "first_byte_ms", "error",
                                          "elsewhere")} for t in trials]}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} ms"


def _start(args: argparse.Namespace, prompts: list[Prompt], workdir: Path,
           procs: list[ServerProcess]) -> tuple[str, list[str], int, dict[str, str]]:
    """The daemon, the engines, the router and a bare router per engine; the router's URL, the
    engines', its pid, each engine's bare router's URL."""
    socket_path = workdir / "kv.sock"
    daemon = ServerProcess([sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                            str(socket_path), "--dram", args.dram, "--http", "off"],
                           "kvstore serve")
    procs.append(daemon)
    daemon.wait_for(r"kvstore: ready", args.start_timeout)
    _, max_positions = model_shape(args.model_dir, args.block_size)
    longest = max(args.sizes) * 1.3 + args.max_tokens + 64
    max_model_len = min(max_positions, -(-int(longest) // args.block_size) * args.block_size)
    num_blocks = args.num_kv_blocks or sum(-(-int(p.size * 1.3) // args.block_size) + 4
                                           for p in prompts) + 64
    urls = []
    for i in range(args.engines):
        device = f"cuda:{i}" if args.device == "cuda" else "cpu"
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(args.model_dir),
               "--device", device, "--port", "0", "--kv-offload", "--kv-store-socket",
               str(socket_path), "--max-model-len", str(max_model_len), "--block-size",
               str(args.block_size), "--max-num-seqs", "8", "--num-kv-blocks", str(num_blocks)]
        engine = ServerProcess(cmd, f"kvengine serve ({device})")
        procs.append(engine)
        urls.append(engine.wait_for(r"listening on (http://\S+)", args.start_timeout).group(1))
    cmd = [sys.executable, "-m", "server.cli", "router", str(args.model_dir), "--routing", "kv",
           "--port", "0", "--kv-store-socket", str(socket_path), "--engine-header", "url"]
    cmd += [arg for url in urls for arg in ("--engine", url)]
    router = ServerProcess(cmd, "kvengine router")
    procs.append(router)
    router_url = router.wait_for(r"listening on (http://\S+)", args.start_timeout).group(1)
    hops = {}
    for url in urls:
        bare = ServerProcess([sys.executable, "-m", "server.cli", "router", str(args.model_dir),
                              "--routing", "round-robin", "--port", "0", "--engine", url],
                             "kvengine router (bare)")
        procs.append(bare)
        hops[url] = bare.wait_for(r"listening on (http://\S+)", args.start_timeout).group(1)
    deadline = time.monotonic() + args.start_timeout
    for url in (router_url, *hops.values()):
        while httpx.get(url + "/ready", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router at {url} never became ready")
            time.sleep(0.2)
    return router_url, urls, router.proc.pid, hops


def _machine_tag(device: str) -> str:
    gpu = (machine_info().get("gpu") or "").lower()
    names = [name for name in ("h200", "h100") if device == "cuda" and name in gpu]
    return names[0] if names else f"{device}-{os.cpu_count()}core"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--engines", type=int, default=2, help="engines behind the router")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[200, 4000], help="prompt sizes in tokens (default: 200,4000)")
    p.add_argument("--prompts-per-size", type=int, default=2, help="of each kind")
    p.add_argument("--reps", type=int, default=40, help="sends of each prompt, each way")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--gap-ms", type=float, default=20.0, help="pause between sends")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="per engine (default: every prompt fits, with room)")
    p.add_argument("--dram", default="1GiB", help="the daemon's DRAM tier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="the machine in the file name (default: h100, "
                   "cpu-2core, ...)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engines < 1 or args.reps < 1 or args.prompts_per_size < 1:
        parser.error("--engines, --reps and --prompts-per-size must be at least 1")
    if not args.sizes or min(args.sizes) < 2 * args.block_size:
        parser.error(f"--sizes: each at least {2 * args.block_size} tokens")
    if not (args.model_dir / "config.json").exists():
        parser.error(f"--model-dir {args.model_dir}: no config.json")
    prompts = _prompts(args, tokens_per_word_of(args.model_dir, args.seed) or 1.3)
    workdir = Path(tempfile.mkdtemp(prefix="kv-router-overhead-"))
    procs: list[ServerProcess] = []
    rng = random.Random(args.seed)
    by_size: dict[str, dict] = {}
    try:
        router_url, engine_urls, router_pid, hops = _start(args, prompts, workdir, procs)
        with httpx.Client(timeout=300, trust_env=False) as client:
            warm(client, router_url, engine_urls, prompts, tries=20)
            for size in args.sizes:
                by_size[str(size)] = entry = measure_size(
                    client, router_url, router_pid, [p for p in prompts if p.size == size], args,
                    rng, hops)
                ttft, router = entry["ttft_ms"], entry["router"]
                print(f"{size} tokens: direct p50 {_ms(ttft['direct']['p50'])}, routed p50 "
                      f"{_ms(ttft['routed']['p50'])}: added p50 {_ms(ttft['added_p50_ms'])}, "
                      f"p90 {_ms(ttft['added_p90_ms'])} (paired p50 "
                      f"{_ms(entry['paired_added_ms']['p50'])}); router: route "
                      f"p50 {_ms(router['route_p50_ms'])} (prompt {_ms(router['prompt_p50_ms'])}, "
                      f"locate {_ms(router['kv_locate_p50_ms'])}), CPU "
                      f"{_ms(router['cpu_ms_per_request'])} a request; reasons "
                      f"{router['requests_by_reason']}; routed elsewhere "
                      f"{entry['num_routed_elsewhere']}; a bare router hop (round-robin, one "
                      f"engine) adds p50 {_ms(ttft['hop_added_p50_ms'])}, the kv routing "
                      f"{_ms(ttft['routing_added_p50_ms'])} beyond it", flush=True)
    except Exception:
        for proc in procs[1:]:  # the engines' and the router's last lines say why
            print(f"--- {proc.name}:", *list(proc.lines)[-15:], sep="\n", file=sys.stderr)
        raise
    finally:
        for proc in reversed(procs):
            proc.stop(signal.SIGINT)
        shutil.rmtree(workdir, ignore_errors=True)
    met = {size: e["ttft_ms"]["added_p50_ms"] is not None
           and e["ttft_ms"]["added_p50_ms"] <= TARGET_ADDED_P50_MS
           and not e["router"]["requests_by_reason"].get("fallback")
           for size, e in by_size.items()}
    print(f"target: at most {TARGET_ADDED_P50_MS} ms added at p50, no fallback: "
          + ", ".join(f"{s} tokens {'met' if ok else 'missed'}" for s, ok in met.items()))
    tag = args.tag or _machine_tag(args.device)
    out = {"benchmark": "router_overhead", "device": args.device, "engines": args.engines,
           "engine_urls": engine_urls, "sizes": by_size, "target_added_p50_ms":
           TARGET_ADDED_P50_MS, "target_met": met, "machine": machine_info(), "date": now_iso(),
           "command": command("python -m benchmarks.router_overhead", argv)}
    print(f"wrote {write_result(args.out, f'router-overhead-{tag}-{today()}.json', out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
