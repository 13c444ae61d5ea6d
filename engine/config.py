"""The engine's configuration: one frozen dataclass, validated once at construction."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from offload.offload_policy import OffloadPolicy

DEVICES = ("auto", "cpu", "cuda")  # and "cuda:N": one GPU by index, as torch and vLLM name them
_CUDA_INDEX = re.compile(r"cuda:(0|[1-9][0-9]{0,3})")
OFFLOAD_POLICIES = tuple(p.value for p in OffloadPolicy)
RESTORE_MODES = ("cost-aware", "always")
PREFILL_ORDERS = ("shortest-first", "fcfs")
# A first turn's few hundred new tokens over a cached system prompt are launch-bound too: on an
# H200 a 700-token step over 4k cached ran 16.4 ms from a graph, 17.7 ms eager, and its spread
# beside the engine's other threads went (first_turn_cost, s33).
DEFAULT_MAX_PREFILL_GRAPH_TOKENS = 1024
MIN_PREFILL_GRAPH_TOKENS = 16  # the smallest prefill graph bucket
# vLLM's --dtype spellings -> ours; what a backend computes in is checked at engine start.
DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
          "half": "float16", "float32": "float32", "float": "float32"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    """How to run one model. ``None`` fields are derived at engine start:

    - ``num_kv_blocks``: on CPU, ``cpu_kv_cache_bytes`` worth of blocks, no more than
      ``max_num_seqs`` full-length sequences need; on GPU, from ``gpu_memory_utilization``.
    - ``max_model_len``: the checkpoint's ``max_position_embeddings``, capped to what the KV arena
      holds. An explicit value larger than either is an error.
    - ``served_model_name``: the model folder's name.
    - ``tokenizer_dir``: the model folder.

    ``dtype`` is what weights and activations must be in ("auto": the backend's own: float32 on
    CPU, bfloat16 on GPU); a dtype the backend does not compute in stops the engine at start.
    ``seed`` seeds the random streams of requests that bring no seed of their own (None: OS
    entropy). ``chat_template`` replaces the tokenizer folder's template (the template text).
    """

    model_dir: str
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Which prefill gets the budget first (engine/prefill_order.py): "shortest-first" (a restored
    # or short prompt before a long cold one) or "fcfs"; a prefill waits at most this many steps.
    prefill_order: str = "shortest-first"
    max_prefill_wait_steps: int = 4
    # While a restore is in flight or a prefill finishes in the step, a prefill that does not
    # finish takes at most this many tokens (short steps for first tokens); None: off.
    latency_chunk_tokens: int | None = None
    kv_offload: bool = False
    kv_store_socket: str | None = None
    kv_offload_policy: str = "write-through"
    kv_offload_restore: str = "cost-aware"  # "always": restore even when recompute is faster
    # Publish the prefix cache's blocks as the store's HBM tier: other engines on the same daemon
    # (same device or a peer) copy them from this arena instead of recomputing them.
    kv_offload_share_hbm: bool = True
    served_model_name: str | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # GPU: no CUDA graphs for decode steps
    # GPU: prefill steps (every sequence sampling, at most 4) of up to this many new tokens
    # replay from CUDA graphs (engine/prefill_graphs.py); vLLM's max_cudagraph_capture_size.
    max_prefill_graph_tokens: int = DEFAULT_MAX_PREFILL_GRAPH_TOKENS
    cpu_kv_cache_bytes: int = 2 * 1024**3
    debug_hash_bits: int | None = None  # truncate block hashes (collision tests only)
    dtype: str = "auto"
    seed: int | None = None
    tokenizer_dir: str | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_dir, (str, Path)) or not str(self.model_dir):
            raise ValueError("model_dir must be a non-empty path")
        object.__setattr__(self, "model_dir", str(self.model_dir))
        check_device(self.device)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "cpu_kv_cache_bytes",
                     "max_prefill_graph_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_prefill_graph_tokens < MIN_PREFILL_GRAPH_TOKENS:
            raise ValueError(f"max_prefill_graph_tokens must be at least "
                             f"{MIN_PREFILL_GRAPH_TOKENS}, got {self.max_prefill_graph_tokens}")
        if self.block_size > 1024:
            raise ValueError(f"block_size must be at most 1024, got {self.block_size}")
        for name in ("num_kv_blocks", "max_model_len", "latency_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        utilization = self.gpu_memory_utilization
        if (not isinstance(utilization, (int, float)) or isinstance(utilization, bool)
                or not math.isfinite(utilization) or not 0.0 < utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, "
                             f"got {self.prefill_order!r}")
        wait = self.max_prefill_wait_steps
        if not _is_int(wait) or wait < 0:
            raise ValueError(f"max_prefill_wait_steps must be a non-negative integer, "
                             f"got {wait!r}")
        if self.kv_offload_policy not in OFFLOAD_POLICIES:
            raise ValueError(f"kv_offload_policy must be one of {OFFLOAD_POLICIES}, "
                             f"got {self.kv_offload_policy!r}")
        if self.kv_offload_restore not in RESTORE_MODES:
            raise ValueError(f"kv_offload_restore must be one of {RESTORE_MODES}, "
                             f"got {self.kv_offload_restore!r}")
        for name in ("kv_offload", "enable_prefix_caching", "enforce_eager",
                     "kv_offload_share_hbm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")
        if self.kv_store_socket is not None:
            object.__setattr__(self, "kv_store_socket", str(self.kv_store_socket))
        if self.served_model_name is not None and (
                not isinstance(self.served_model_name, str) or not self.served_model_name):
            raise ValueError("served_model_name must be a non-empty string or None")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        if self.tokenizer_dir is not None:
            object.__setattr__(self, "tokenizer_dir", str(self.tokenizer_dir))
        if self.chat_template is not None and (
                not isinstance(self.chat_template, str) or not self.chat_template.strip()):
            raise ValueError("chat_template must be non-empty template text or None")
        bits = self.debug_hash_bits
        if bits is not None and (not _is_int(bits) or not 1 <= bits <= 128):
            raise ValueError(f"debug_hash_bits must be in 1..128 or None, got {bits!r}")


def check_dtype(wanted: str, computes_in: str, device: str) -> None:
    """ValueError unless ``wanted`` ("auto" or a dtype name) is what the backend computes in."""
    if wanted not in ("auto", computes_in):
        raise ValueError(f"--dtype {wanted} is not supported on {device}: this backend computes "
                         f"in {computes_in} (use --dtype auto or {computes_in})")


def check_device(device: object) -> str:
    """``device`` if it is "auto", "cpu", "cuda" or "cuda:N"; ValueError otherwise."""
    if not isinstance(device, str) or device not in DEVICES and not _CUDA_INDEX.fullmatch(device):
        raise ValueError(f"device must be one of {DEVICES} or cuda:N (N a GPU index), "
                         f"got {device!r}")
    return device


def cuda_index(device: str) -> int | None:
    """N of "cuda:N"; None for any other device (plain "cuda" is whichever GPU is current)."""
    match = _CUDA_INDEX.fullmatch(device)
    return int(match.group(1)) if match else None


def use_cuda_device(index: int) -> None:
    """Make GPU ``index`` current on the calling thread (CUDA's current device is per thread:
    every thread that launches work on the engine's arrays calls this first)."""
    import cupy

    cupy.cuda.Device(index).use()


def resolve_device(device: str) -> str:
    """The backend: "auto" -> "cuda" when CuPy sees a GPU, else "cpu"; "cpu"/"cuda" pass
    through; "cuda:N" -> "cuda" with GPU N made current on this thread (before anything is
    allocated), N counted among the GPUs CUDA_VISIBLE_DEVICES leaves visible. ValueError for a
    GPU that is not there."""
    index = cuda_index(device)
    if index is not None:
        try:
            import cupy

            num_devices = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # no CuPy, no driver
            raise ValueError(f"device {device}: no CUDA device is usable here ({exc})") from None
        if index >= num_devices:
            raise ValueError(f"device {device}: this process sees {num_devices} CUDA device(s) "
                             "(after CUDA_VISIBLE_DEVICES)")
        use_cuda_device(index)
        return "cuda"
    if device != "auto":
        return device
    try:
        import cupy

        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # no CuPy, no driver, no device: all mean CPU
        return "cpu"
