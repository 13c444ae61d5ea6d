"""The `kvengine` command: `serve` runs the OpenAI-compatible server; `make-model` a model."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.cli.args import (
    OneLineParser,
    add_config_option,
    add_version,
    expand_sources,
    subcommand,
)
from kvstore.process_guard import forbid_inspection
from server.engine_protocol import ServedEngine
from server.http_front import bind_listener, connection_limits, run_app
from server.http_front_args import api_keys, metrics_key
from server.log_setup import BANNER_LOGGER, add_log_format_option
from server.router.args import add_router_arguments
from server.serve_args import add_serve_arguments, tool_settings
from server.vllm_flags import add_vllm_flags
from server.vllm_flags import notes as vllm_flag_notes

# The GIL switch interval (Python's: 5 ms): the link thread and the client's reader wait for the
# GIL up to this long beside the busy step thread, and a late lookup reply costs a restore whole
# steps (docs/measurements.md).
SERVE_SWITCH_INTERVAL_S = 0.0005
ENV_PREFIX = "KVENGINE_"  # KVENGINE_MAX_MODEL_LEN=4096 is --max-model-len 4096
_BANNER = logging.getLogger(BANNER_LOGGER)  # the start-up lines: configure_logging sets it up


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `kvengine`."""
    parser = OneLineParser(
        prog="kvengine", description="An inference engine with a tiered KV-cache store.")
    add_version(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=OneLineParser)
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(serve)
    add_config_option(serve, ENV_PREFIX, "MAX_MODEL_LEN=4096")
    add_log_format_option(serve)
    add_vllm_flags(serve)
    parser.set_defaults(serve_parser=serve)
    router_parser = commands.add_parser(
        "router", help="an OpenAI-compatible front for several engines sharing one kvstore "
        "daemon: each request to the engine holding its prefix (see router --help)")
    add_router_arguments(router_parser)
    add_config_option(router_parser, ENV_PREFIX, "ROUTING=kv")
    add_log_format_option(router_parser)
    commands.add_parser("make-model", add_help=False,
                        help="write a random-weight model folder (see make-model --help)")
    return parser


def _engine_config(args: argparse.Namespace, model_dir: Path, tokenizer_dir: Path | None) -> Any:
    from engine import EngineConfig

    fields: dict[str, Any] = {
        "model_dir": str(model_dir),
        "tokenizer_dir": None if tokenizer_dir is None else str(tokenizer_dir),
        "dtype": args.dtype,
        "seed": args.seed,
        "chat_template": args.chat_template,
        "device": args.device,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "kv_offload": args.kv_offload,
        "kv_store_socket": args.kv_store_socket,
        "kv_offload_policy": args.kv_offload_policy,
        "served_model_name": args.served_model_name[0] if args.served_model_name else None,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "max_prefill_graph_tokens": args.max_prefill_graph_tokens,
        "kv_offload_share_hbm": args.kv_offload_share_hbm,
        "prefill_order": args.prefill_order,
        "max_prefill_wait_steps": args.max_prefill_wait_steps,
        "latency_chunk_tokens": args.latency_chunk_tokens,
    }
    if args.max_num_batched_tokens is not None:
        fields["max_num_batched_tokens"] = args.max_num_batched_tokens
    return EngineConfig(**fields)


class WarmUpFailed(RuntimeError):
    """The engine loaded but its start-time warm-up (graph captures) failed; it is closed."""


def _load_engine(config: Any, warm_up: bool = True) -> ServedEngine:
    from engine import LLMEngine

    _BANNER.info("kvengine: loading %s ...", config.model_dir)
    start = time.perf_counter()
    engine = LLMEngine(config)
    _BANNER.info("kvengine: model loaded in %.1f s", time.perf_counter() - start)
    if warm_up:  # before "listening on": no request pays for a graph capture or cuDNN build
        start = time.perf_counter()
        try:
            num_graphs = engine.warm_up()
        except Exception as exc:  # a capture or a cuDNN run failed (a refused shape does not)
            engine.close()
            raise WarmUpFailed(f"the start-time warm-up failed ({type(exc).__name__}: {exc}); "
                               "--no-warm-up starts without it") from exc
        except BaseException:
            engine.close()
            raise
        ops = engine.runner.ops
        if num_graphs:
            _BANNER.info("kvengine: warm-up captured %d CUDA graphs (%d attention graphs "
                         "built) in %.1f s (%s)", num_graphs, ops.num_attention_graphs,
                         time.perf_counter() - start, _build_times(ops.builds.snapshot()))
        if ops.weights_upload_s is not None:
            _BANNER.info("kvengine: weights uploaded in %.1f s, beside the warm-up",
                         ops.weights_upload_s)
    return engine


def _build_times(snapshot: dict) -> str:
    """The start's builds by kind, e.g. ``cuda_graph 32 in 1.61 s, cudnn_plan_load 39 in 0.19
    s``: where a warm-up's time went."""
    return ", ".join(f"{kind} {count} in {snapshot['seconds_before'].get(kind, 0.0):.2f} s"
                     for kind, count in sorted(snapshot["before"].items())) or "no builds"


def _startup_line(engine: ServedEngine, model_name: str, host: str, port: int) -> str:
    num_blocks = engine.stats().get("num_kv_blocks", "?")
    device, block_size = engine.device, engine.config.block_size
    shown_host = f"[{host}]" if ":" in host else host
    return (f"kvengine: serving {model_name} on {device}: {num_blocks} KV blocks of {block_size} "
            f"tokens, max_model_len {engine.max_model_len}; listening on "
            f"http://{shown_host}:{port}")


def _model_folders(args: argparse.Namespace,
                   parser: argparse.ArgumentParser) -> tuple[Path, Path | None]:
    """The model folder and the tokenizer folder (None: the model's), hub ids resolved."""
    from server.model_source import ModelNotFound, resolve_model

    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"MODEL {args.model_tag} and --model {args.model} differ: give one")
    name = args.model_tag or args.model
    if not name:
        parser.error("a model is required: kvengine serve MODEL (or --model MODEL)")
    try:
        model_dir = resolve_model(name, args.revision)
        tokenizer_dir = None if args.tokenizer is None else resolve_model(args.tokenizer)
    except ModelNotFound as exc:
        parser.error(str(exc))
    return model_dir, tokenizer_dir


def _sampling_defaults(args: argparse.Namespace, model_dir: Path) -> Any:
    from engine.generation_config import GENERATION_CONFIG_FILE, sampling_defaults
    from server.protocol import ChatCompletionRequest, CompletionRequest
    from server.sampling_defaults import SamplingDefaults

    if args.generation_config == "vllm":
        return None
    folder = model_dir if args.generation_config == "auto" else Path(args.generation_config)
    if args.generation_config != "auto" and not (folder / GENERATION_CONFIG_FILE).is_file():
        raise ValueError(f"--generation-config {folder}: no {GENERATION_CONFIG_FILE} there")
    return SamplingDefaults(sampling_defaults(folder),
                            (CompletionRequest, ChatCompletionRequest),
                            source=str(folder / GENERATION_CONFIG_FILE))


def _check_timing_log(path: str) -> None:
    """ValueError unless ``--request-timing-log`` can be opened for appending."""
    from server.request_timing_log import RequestTimingLog

    try:
        RequestTimingLog(path).close()
    except OSError as exc:
        raise ValueError(f"--request-timing-log {path}: {exc.strerror or exc}") from exc


def tune_interpreter() -> None:
    """What the serving process sets in the interpreter (see ``SERVE_SWITCH_INTERVAL_S``)."""
    sys.setswitchinterval(SERVE_SWITCH_INTERVAL_S)


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Load the engine, then serve it until interrupted."""
    from server.app import build_app
    from server.log_setup import configure_logging
    from server.settings import ServerSettings

    banner = configure_logging(args.log_level, args.log_format)
    for note in vllm_flag_notes(args):
        banner.info("%s", note)
    tune_interpreter()
    model_dir, tokenizer_dir = _model_folders(args, parser)
    name = args.model_tag or args.model
    if not args.served_model_name and not Path(name).expanduser().is_dir():
        args.served_model_name = [name]  # a hub id names the model, as in vLLM
    try:
        config = _engine_config(args, model_dir, tokenizer_dir)
        names = tuple(args.served_model_name or ())
        settings = ServerSettings(served_model_name=names[0] if names else None,
                                  model_aliases=names[1:], api_keys=api_keys(args),
                                  max_queue=args.max_queue,
                                  max_request_body_bytes=args.max_request_body_bytes,
                                  metrics_key=metrics_key(args),
                                  sampling_defaults=_sampling_defaults(args, model_dir),
                                  tools=tool_settings(args), reasoning_parser=args.reasoning_parser,
                                  request_timing_log=args.request_timing_log)
        limits = connection_limits(args)
        if args.request_timing_log is not None:  # fails here, before the model loads
            _check_timing_log(args.request_timing_log)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    try:  # bound before the model loads: a busy port costs a second, not a model load
        listener = bind_listener(args.host, args.port)
    except OSError as exc:
        banner.error("kvengine: error: cannot listen on %s:%d: %s", args.host, args.port,
                     exc.strerror or exc)
        return 1
    from server.package_check import foreign_kernels_owners, kernels_conflict_message

    owners = foreign_kernels_owners()
    if owners:  # checked before the engine imports `kernels`, which may be the other one
        listener.close()
        banner.error("kvengine: error: %s", kernels_conflict_message(owners))
        return 1
    try:
        engine = _load_engine(config, args.warm_up)
    except (OSError, ValueError, NotImplementedError, WarmUpFailed) as exc:
        listener.close()
        banner.error("kvengine: error: cannot start the engine on %s: %s", model_dir, exc)
        return 1
    if config.kv_offload and engine.device == "cpu" and not args.dumpable:
        forbid_inspection()  # its KV arena is a memfd, openable through /proc by its uid
    try:
        app = build_app(engine, settings)
        model_name = app.state.model_name
        return run_app(app, args, limits, listener,
                        lambda port: _startup_line(engine, model_name, args.host, port))
    finally:
        listener.close()
        engine.close()


def router(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`kvengine router`: serve the OpenAI API in front of ``--engine`` URLs until
    interrupted."""
    from server.log_setup import configure_logging
    from server.router.setup import build_router

    banner = configure_logging(args.log_level, args.log_format)
    tune_interpreter()
    model_dir, tokenizer_dir = _model_folders(args, parser)
    try:
        app = build_router(args, model_dir, tokenizer_dir)
        limits = connection_limits(args)
    except (ValueError, TypeError, OSError) as exc:
        parser.error(str(exc))
    try:
        listener = bind_listener(args.host, args.port)
    except OSError as exc:
        banner.error("kvengine: error: cannot listen on %s:%d: %s", args.host, args.port,
                     exc.strerror or exc)
        return 1
    shown_host = f"[{args.host}]" if ":" in args.host else args.host
    socket_path = args.kv_store_socket or "the default kvstore socket"
    try:
        return run_app(app, args, limits, listener, lambda port: (
            f"kvengine router: routing {args.model_tag or args.model} over "
            f"{len(args.engines)} engines (--routing {args.routing}, daemon at {socket_path}); "
            f"listening on http://{shown_host}:{port}"))
    finally:
        listener.close()


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, except that in `serve --model DIR --typo 8000` the typo's value, which
    argparse hands to the positional MODEL, is reported with the typo."""
    args, extras = parser.parse_known_args(argv)
    if extras and args.command == "serve" and args.model_tag and args.model:
        tail = argv[argv.index(extras[0]):]
        shown = [token for token in tail if token in extras or token == args.model_tag]
        args.serve_parser.error(f"unrecognized arguments: {' '.join(shown)}")
    return parser.parse_args(argv) if extras else args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvengine` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "make-model":
        from engine.make_model import main as make_model_main

        result = make_model_main(argv[1:])
        return result if isinstance(result, int) else 0
    parser = build_parser()
    if argv and argv[0] in ("serve", "router"):
        try:
            argv = [argv[0], *expand_sources(subcommand(parser, argv[0]), argv[1:], ENV_PREFIX)]
        except ValueError as exc:
            print(f"kvengine {argv[0]}: error: {exc}", file=sys.stderr)
            return 2
    args = _parse(parser, argv)
    if args.command == "serve":
        return serve(args, parser)
    if args.command == "router":
        return router(args, parser)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
