"""The `kvengine` command: `serve` runs the OpenAI-compatible server; `make-model` a model."""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn

from kvstore.cli_support import OneLineParser, add_version
from server.connection_guard import ConnectionGuard, ConnectionLimits, fit_to_open_files
from server.engine_protocol import ServedEngine
from server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `kvengine`."""
    parser = OneLineParser(
        prog="kvengine", description="An inference engine with a tiered KV-cache store.")
    add_version(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=OneLineParser)
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", required=True, help="model folder (config.json, "
                       "*.safetensors, tokenizer.json); required")
    serve.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="where the model runs; auto takes the GPU when CuPy sees one")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_port, default=8000,
                       help="port to listen on; 0 picks a free one")
    serve.add_argument("--kv-offload", action="store_true",
                       help="load cached prefixes from the kvstore daemon and save new blocks")
    serve.add_argument("--kv-store-socket", default=None, help="the daemon's socket "
                       "(default: $KVSTORE_SOCKET, else the per-user default)")
    serve.add_argument("--kv-offload-policy", choices=("write-through", "evict"),
                       default="write-through",
                       help="save full blocks after the step that computed them "
                       "(write-through), or only when the engine evicts them (evict)")
    serve.add_argument("--no-kv-offload-share-hbm", dest="kv_offload_share_hbm",
                       action="store_false",
                       help="do not offer this engine's cached blocks to other engines on the "
                       "same daemon (the store's HBM tier)")
    serve.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                       help="KV blocks to allocate (default: from --gpu-memory-utilization)")
    serve.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                       help="fraction of GPU memory the engine may take (weights + KV arena)")
    serve.add_argument("--block-size", type=_positive_int, default=16,
                       help="tokens per KV block")
    serve.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="longest prompt + completion in tokens (default: the model's "
                       "max_position_embeddings, capped by the KV arena)")
    serve.add_argument("--max-num-seqs", type=_positive_int, default=256,
                       help="requests running at once")
    serve.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                       help="tokens computed per step (default: the engine's chunked-prefill "
                       "budget)")
    serve.add_argument("--max-queue", type=_non_negative_int, default=None,
                       help="requests admitted beyond --max-num-seqs before answering 503 "
                       "(default: 2 x --max-num-seqs)")
    serve.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", help="turn the HBM prefix cache off")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="GPU: launch every decode kernel from Python (no CUDA graphs)")
    serve.add_argument("--served-model-name", default=None,
                       help="model name in the API (default: the model folder's name)")
    serve.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY'; repeat for several keys "
                       "(each key is its own cache tenant; default: no key)")
    serve.add_argument("--metrics-key", default=None, metavar="KEY",
                       help="the operator's key for GET /metrics, which shows every tenant's "
                       "traffic (default: $KVENGINE_METRICS_KEY; with --api-key and no metrics "
                       "key /metrics is refused, without --api-key it is open)")
    serve.add_argument("--max-request-body-bytes", type=_positive_int,
                       default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help="larger request bodies get a 413 before they are parsed "
                       "(default: %(default)s = 4 MiB)")
    serve.add_argument("--max-connections", type=_positive_int, default=1024,
                       help="open HTTP connections; more are refused with a 503 at once "
                       "(default: %(default)s, lowered to fit the open-file limit)")
    serve.add_argument("--timeout-keep-alive", type=_seconds, default=5.0, metavar="SECONDS",
                       help="close a connection that sends nothing for this long "
                       "(default: %(default)s)")
    serve.add_argument("--request-read-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                       help="close a connection whose request (headers and body) is not all "
                       "there this long after it began, with a 408 (default: %(default)s)")
    serve.add_argument("--log-level", default="warning",
                       choices=("critical", "error", "warning", "info", "debug"),
                       help="log level (stderr)")
    commands.add_parser("make-model", add_help=False,
                        help="write a random-weight model folder (see make-model --help)")
    return parser


def _engine_config(args: argparse.Namespace) -> Any:
    from engine import EngineConfig

    fields: dict[str, Any] = {
        "model_dir": args.model,
        "device": args.device,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "kv_offload": args.kv_offload,
        "kv_store_socket": args.kv_store_socket,
        "kv_offload_policy": args.kv_offload_policy,
        "served_model_name": args.served_model_name,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "kv_offload_share_hbm": args.kv_offload_share_hbm,
    }
    if args.max_num_batched_tokens is not None:
        fields["max_num_batched_tokens"] = args.max_num_batched_tokens
    return EngineConfig(**fields)


def _load_engine(config: Any) -> ServedEngine:
    from engine import LLMEngine

    print(f"kvengine: loading {config.model_dir} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    engine = LLMEngine(config)
    print(f"kvengine: model loaded in {time.perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)
    return engine


def _connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The connection bounds; the open-file limit is raised as far as the hard limit allows (up
    to 64k), and what it still lacks lowers --max-connections and the accept backlog."""
    wanted = ConnectionLimits(max_connections=args.max_connections,
                              timeout_keep_alive_s=args.timeout_keep_alive,
                              request_read_timeout_s=args.request_read_timeout)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    target = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    limits = fit_to_open_files(wanted, soft)
    if limits.max_connections < wanted.max_connections:
        print(f"kvengine: the open-file limit is {soft}: at most {limits.max_connections} HTTP "
              "connections", file=sys.stderr, flush=True)
    return limits


def _startup_line(engine: ServedEngine, model_name: str, host: str, port: int) -> str:
    num_blocks = engine.stats().get("num_kv_blocks", "?")
    device, block_size = engine.device, engine.config.block_size
    shown_host = f"[{host}]" if ":" in host else host
    return (f"kvengine: serving {model_name} on {device}: {num_blocks} KV blocks of {block_size} "
            f"tokens, max_model_len {engine.max_model_len}; listening on "
            f"http://{shown_host}:{port}")


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Stopped(Exception):
    """A stop signal arrived after uvicorn's graceful shutdown."""


def _raise_stop(signum: int, _frame: Any) -> None:
    raise _Stopped(signum)


class _Server(uvicorn.Server):
    """uvicorn's server, printing our startup line once the socket is bound."""

    def __init__(self, config: uvicorn.Config, line: Any, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self._line = line
        self._guard = guard

    async def startup(self, sockets: list | None = None) -> None:
        self._guard.install(asyncio.get_running_loop())
        await super().startup(sockets)
        if self.started:
            port = self.config.port
            if self.servers and self.servers[0].sockets:
                port = self.servers[0].sockets[0].getsockname()[1]
            print(self._line(port), file=sys.stderr, flush=True)


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Load the engine, then serve it until interrupted."""
    from server.app import build_app
    from server.settings import ServerSettings

    if not Path(args.model).is_dir():
        parser.error(f"--model {args.model}: no such directory")
    try:
        config = _engine_config(args)
        metrics_key = args.metrics_key or os.environ.get("KVENGINE_METRICS_KEY") or None
        settings = ServerSettings(served_model_name=args.served_model_name,
                                  api_keys=tuple(args.api_key or ()), max_queue=args.max_queue,
                                  max_request_body_bytes=args.max_request_body_bytes,
                                  metrics_key=metrics_key)
        limits = _connection_limits(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    try:  # bound before the model loads: a busy port costs a second, not a model load
        listener = _bind(args.host, args.port)
    except OSError as exc:
        print(f"kvengine: error: cannot listen on {args.host}:{args.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        engine = _load_engine(config)
    except (OSError, ValueError, NotImplementedError) as exc:
        listener.close()
        print(f"kvengine: error: cannot start the engine on {args.model}: {exc}",
              file=sys.stderr)
        return 1
    try:
        app = build_app(engine, settings)
        model_name = app.state.model_name
        guard = ConnectionGuard(limits)
        uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   access_log=args.log_level in ("info", "debug"),
                                   timeout_graceful_shutdown=5, http=guard.protocol_factory,
                                   timeout_keep_alive=max(1, round(limits.timeout_keep_alive_s)),
                                   backlog=limits.accept_backlog)
        server = _Server(uv_config, lambda port: _startup_line(engine, model_name, args.host,
                                                                port), guard)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal; our handler
        # turns that into an exception so the engine below is closed (its KV arena freed).
        previous = {sig: signal.signal(sig, _raise_stop) for sig in _STOP_SIGNALS}
        try:
            server.run(sockets=[listener])
        except _Stopped:
            pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 0 if server.started else 1
    finally:
        listener.close()
        engine.close()


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when the host is one); OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvengine` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "make-model":
        from engine.make_model import main as make_model_main

        result = make_model_main(argv[1:])
        return result if isinstance(result, int) else 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args, parser)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
