"""The options of `kvengine serve`: ours plus the `vllm serve` ones a moved command line carries.

A vLLM option is either honoured or refused with one line that says why; none is accepted and
then ignored silently: `--trust-remote-code` (whose help says that nothing remote runs here) and
the harmless ones of `server/vllm_flags.py` (one line at start each says why) change nothing.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.config import (
    DEFAULT_MAX_PREFILL_GRAPH_TOKENS,
    DTYPES,
    MIN_PREFILL_GRAPH_TOKENS,
    OFFLOAD_POLICIES,
    PREFILL_ORDERS,
    check_device,
)
from kvstore.cli.args import (
    fraction_arg,
    non_negative_int_arg,
    positive_int_arg,
)
from offload.offload_policy import OffloadPolicy
from server.http_front_args import ENGINE_FRONT, add_http_front_args
from server.model_args import ENGINE_MODEL, add_model_args
from server.reasoning_parsers import REASONING_PARSERS
from server.tool_parsers import TOOL_PARSERS


def _tensor_parallel_size(text: str) -> int:
    value = positive_int_arg(text)
    if value != 1:
        raise argparse.ArgumentTypeError(f"{value} is not supported: kvengine runs a model on "
                                         "one device (tensor parallelism is not implemented)")
    return value


def _graph_tokens(text: str) -> int:
    value = positive_int_arg(text)
    if value < MIN_PREFILL_GRAPH_TOKENS:
        raise argparse.ArgumentTypeError(
            f"{value} is below {MIN_PREFILL_GRAPH_TOKENS}, the smallest graph")
    return value


def _device(text: str) -> str:
    try:
        return check_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tool_settings(args: argparse.Namespace) -> Any:
    """--enable-auto-tool-choice and --tool-call-parser as the server's ToolSettings
    (ValueError for auto tool choice without a parser)."""
    from server.chat_tools import ToolSettings

    return ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """Every option of `kvengine serve`."""
    add_model_args(serve, ENGINE_MODEL)
    serve.add_argument("--device", type=_device, default="auto", metavar="auto|cpu|cuda|cuda:N",
                       help="where the model runs; auto takes the GPU when CuPy sees one, "
                       "cuda:N the N-th GPU CUDA_VISIBLE_DEVICES leaves visible (one engine per "
                       "GPU beside one kvstore daemon)")
    serve.add_argument("--dtype", choices=tuple(DTYPES), default="auto",
                       help="weights and activations dtype; auto is the backend's own (float32 "
                       "on CPU, bfloat16 on GPU), any other must be that one or start fails")
    serve.add_argument("--seed", type=non_negative_int_arg, default=None,
                       help="seeds the random streams of requests that bring no seed, so a run "
                       "repeats (default: fresh entropy)")
    serve.add_argument("--kv-offload", action="store_true",
                       help="load cached prefixes from the kvstore daemon and save new blocks")
    serve.add_argument("--kv-store-socket", default=None, help="the daemon's socket "
                       "(default: $KVSTORE_SOCKET, else the per-user default)")
    serve.add_argument("--kv-offload-policy", choices=OFFLOAD_POLICIES,
                       default=OffloadPolicy.WRITE_THROUGH.value,
                       help="save full blocks after the step that computed them "
                       "(write-through), or only when the engine evicts them (evict)")
    serve.add_argument("--no-kv-offload-share-hbm", dest="kv_offload_share_hbm",
                       action="store_false",
                       help="do not offer this engine's cached blocks to other engines on the "
                       "same daemon (the store's HBM tier)")
    serve.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks",
                       type=positive_int_arg, default=None,
                       help="KV blocks to allocate (default: from --gpu-memory-utilization); "
                       "--num-gpu-blocks-override is vLLM's name for it")
    serve.add_argument("--gpu-memory-utilization", type=fraction_arg, default=0.9,
                       help="fraction of GPU memory the engine may take (weights + KV arena)")
    serve.add_argument("--block-size", type=positive_int_arg, default=16,
                       help="tokens per KV block")
    serve.add_argument("--max-model-len", type=positive_int_arg, default=None,
                       help="longest prompt + completion in tokens (default: the model's "
                       "max_position_embeddings, capped by the KV arena)")
    serve.add_argument("--max-num-seqs", type=positive_int_arg, default=256,
                       help="requests running at once")
    serve.add_argument("--max-num-batched-tokens", type=positive_int_arg, default=None,
                       help="tokens computed per step (default: the engine's chunked-prefill "
                       "budget)")
    serve.add_argument("--prefill-order", choices=PREFILL_ORDERS, default="shortest-first",
                       help="which prefill gets a step's token budget first: the least prompt "
                       "left (a restored turn before another user's long cold prompt) or "
                       "arrival order")
    serve.add_argument("--max-prefill-wait-steps", type=non_negative_int_arg, default=4,
                       help="shortest-first: a prefill that waited this many steps for a chunk "
                       "goes before the others (no prompt starves)")
    serve.add_argument("--latency-chunk-tokens", type=positive_int_arg, default=None,
                       help="while a restore is in flight or some prefill finishes in the step, "
                       "a prefill that cannot finish takes at most this many tokens (shorter "
                       "steps for first tokens); default: off")
    serve.add_argument("--max-queue", type=non_negative_int_arg, default=None,
                       help="requests admitted beyond --max-num-seqs before answering 503 "
                       "(default: 2 x --max-num-seqs)")
    serve.add_argument("--tensor-parallel-size", "-tp", type=_tensor_parallel_size, default=1,
                       help="only 1: kvengine runs a model on one device")
    serve.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_true", default=True,
                       help="keep the HBM prefix cache on (default: on)")
    serve.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", help="turn the HBM prefix cache off")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="GPU: launch every decode kernel from Python (no CUDA graphs)")
    serve.add_argument("--max-prefill-graph-tokens", type=_graph_tokens,
                       default=DEFAULT_MAX_PREFILL_GRAPH_TOKENS,
                       help="GPU: prefill steps of up to this many new tokens (at most 4 "
                       "sequences, all finishing their prompt) replay from CUDA graphs "
                       "captured before /ready; past 256 in steps of 256, the last bucket rounded "
                       "up, no more than --max-num-batched-tokens (default: %(default)s)")
    serve.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                       help="GPU: skip capturing the short prefill and decode graphs (and the "
                       "cuDNN graphs they use) before listening; the first requests pay for it")
    serve.add_argument("--dumpable", action="store_true",
                       help="CPU with --kv-offload: keep core dumps and debuggers (gdb, py-spy); "
                       "by default the engine is then not dumpable, so no other process of its "
                       "user can open its KV arena (a memfd) through /proc/PID/fd")
    serve.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM command lines; it changes nothing: kvengine "
                       "never runs code from a model folder (it reads JSON and safetensors)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide when to call tools (tool_choice auto, the "
                       "default with tools); needs --tool-call-parser")
    serve.add_argument("--tool-call-parser", choices=tuple(TOOL_PARSERS), default=None,
                       help="the model's tool-call format: hermes (Qwen2.5, Qwen3, Hermes: "
                       "<tool_call> blocks) or llama3_json (Llama 3.1-3.3); also the format "
                       "tool_choice required / a named function is forced into (default: hermes)")
    serve.add_argument("--reasoning-parser", choices=tuple(REASONING_PARSERS), default=None,
                       help="split a thinking model's <think> block off its chat answers as "
                       "reasoning_content: qwen3 (default: off)")
    serve.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                       help="sampling defaults for fields a request leaves out: auto reads the "
                       "model's generation_config.json (temperature, top_p, top_k, min_p, "
                       "repetition_penalty, max_new_tokens), vllm uses none, FOLDER reads "
                       "FOLDER/generation_config.json")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model names in the API; requests may use any, responses carry "
                       "the first (default: the model folder's name)")
    serve.add_argument("--request-timing-log", default=None, metavar="FILE",
                       help="append one JSON line per finished request to FILE: its id and "
                       "time stamps (received, added, scheduled, first token, finished) on "
                       "the host's monotonic clock, to see where a request's time went (default: "
                       "off)")
    add_http_front_args(serve, ENGINE_FRONT)
