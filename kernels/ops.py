"""The op set the model code calls, as a small ABC: one implementation per backend.

The model is written once over ``Ops``. ``NumpyOps`` (CPU, float32) runs the references in
``kernels/reference.py``; a CuPy implementation (bf16 storage, fp32 accumulation) provides the same
methods with ``.cu`` kernels. Shapes, dtypes and semantics are stated once, in the reference
docstrings; ``KERNELS.md`` indexes them. Arrays are the backend's arrays (``xp.ndarray``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from kernels.build_log import BuildLog

Array = Any  # numpy.ndarray or cupy.ndarray, as the backend decides


class CapturedGraph(ABC):
    """Device work recorded once and replayed on the same buffers (a CUDA graph).

    ``output`` is the array the captured function returned; every ``replay()`` rewrites it in
    place from whatever the captured inputs hold at that moment. The graph owns the memory of its
    intermediates for its whole life.
    """

    output: Array

    @abstractmethod
    def replay(self) -> Array:
        """Enqueue the recorded work on the current stream; returns ``output`` (not synced)."""


class Ops(ABC):
    """Kernels plus the few transfers the model runner needs. Stateless apart from the device.

    ``act_dtype`` is the dtype of activations and weights on this backend; ``kv_dtype`` names the
    KV arena's dtype (part of the block namespace: different bytes, different keys).
    """

    name: str
    xp: ModuleType
    act_dtype: Any
    kv_dtype: str

    supports_graphs = False
    # Which attention runs: {"prefill": ..., "decode": ...}, each "reference", "ours" or "cudnn"
    attention_backends: dict[str, str] = {"prefill": "reference", "decode": "reference"}
    num_attention_fallbacks = 0  # attention calls the chosen backend refused (ours served them)

    @property
    def attention_backend(self) -> str:
        """One line for logs and /metrics, e.g. ``prefill=cudnn decode=ours``."""
        return " ".join(f"{phase}={name}" for phase, name in self.attention_backends.items())

    @property
    def builds(self) -> BuildLog:
        """What this backend built (graph captures, attention graphs), before and after the
        engine said ready; one log per instance."""
        builds = self.__dict__.get("_builds")
        if builds is None:
            builds = self.__dict__["_builds"] = BuildLog()
        return builds

    def close(self) -> None:
        """Ends what this backend runs beside the engine (the cuDNN plan builder); idempotent.
        The base runs nothing beside it."""
        return None

    def preload_attention_plans(self, scope: tuple) -> int:
        """Before ready: load the attention graphs earlier starts of ``scope`` (the model and
        its KV arena) used, so a warm restart's requests load none in line; how many. The base
        has none to load."""
        return 0

    def warm_kernels(self, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     vocab_size: int) -> None:
        """Before ready: compile every kernel a request's path can reach for this model's
        shape, so none is compiled while a request waits (``BuildKind.KERNEL_MODULE``). The
        base compiles nothing (host backends run precompiled code)."""
        return None

    @property
    def allocator_bytes(self) -> dict[str, int]:
        """Device memory the backend's allocator holds (``held``) and has handed out now
        (``in_use``); the difference is its cache of freed blocks, which later steps reuse. Empty
        where no device allocator caches (host backends)."""
        return {}

    @property
    def background_builds(self) -> dict[str, int]:
        """What the background plan builder did, by outcome (``PlanBuilder.counts``); empty
        where none runs."""
        return {}

    def load_built_plans(self, nobody_waits: Callable[[], bool]) -> int:
        """While ``nobody_waits()`` (the device runs a step the host waits for anyway, or the
        engine is idle): load the attention graphs a background builder has finished, so no
        request loads one in its path. How many were taken; the base has no builder."""
        return 0

    @property
    def num_attention_graphs(self) -> int:
        """Attention graphs built so far (cuDNN builds one per shape bucket on first use, a
        one-time cost of ~0.1 s each); 0 for backends that build none."""
        return 0

    def capture_graph(self, fn: Callable[[], Array], key: object = None) -> CapturedGraph:
        """Record ``fn`` (device work only: no host sync, no host-dependent shapes) into a graph;
        ``key`` names it in ``builds``.

        ``fn`` is run once eagerly first (compiles kernels, warms libraries), then captured.
        Backends without graphs (``supports_graphs`` false) raise NotImplementedError.
        """
        raise NotImplementedError(f"the {self.name} backend has no graphs")

    # -- transfers ---------------------------------------------------------------------------

    @abstractmethod
    def weight_from_host(self, raw: np.ndarray, dtype: str) -> Array:
        """A checkpoint tensor on the device in ``act_dtype``.

        ``raw`` holds the file's values: float32/float16 arrays as such, bfloat16 as the uint16 bit
        patterns (NumPy has no bf16), ``dtype`` says which ("float32", "float16", "bfloat16").
        The array's address is final at once; its bytes may arrive later, in the background,
        once ``weights_loaded`` is called: work that keeps its results may read it only after
        ``weights_ready`` (a warm-up, whose results are thrown away, may run before).
        """

    def stacked_weight_from_host(self, parts: list[tuple[np.ndarray, str]]) -> Array:
        """Checkpoint tensors (``(raw, dtype)`` as ``weight_from_host`` takes them) joined
        along their first axis: a fused projection (q, k and v; gate and up). Same arrival
        rules as ``weight_from_host``."""
        return self.xp.concatenate([self.weight_from_host(raw, dtype) for raw, dtype in parts],
                                   axis=0)

    def weights_loaded(self) -> None:
        """The last ``weight_from_host`` of a load was made: its bytes start moving (in the
        background where the backend can; a backend that copies synchronously has nothing to
        do)."""
        return None

    def weights_ready(self) -> None:
        """Wait until every weight a load asked for is on the device and release what staged
        them; raise if some never arrived (and on every call after). Nothing to do on a
        synchronous backend."""
        return None

    @property
    def weights_upload_s(self) -> float | None:
        """Seconds the last background upload of weights took (None: none ran)."""
        return None

    def work_done_marker(self) -> Callable[[], bool] | None:
        """A check that the device work queued so far (on the current stream) has finished:
        another process that reads the memory it writes (the kvstore daemon copying a block
        out) must not start before. None for a backend that runs synchronously."""
        return None

    @abstractmethod
    def to_device(self, host: np.ndarray) -> Array:
        """Copy a host array (index metadata, small tables) to the device, keeping its dtype."""

    @abstractmethod
    def to_host(self, x: Array) -> np.ndarray:
        """Copy a device array back to a host NumPy array."""

    # -- kernels (contracts: kernels/reference.py) --------------------------------------------

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        """``x[T, in] @ weight[out, in].T (+ bias[out])``: a plain GEMM through the array module."""
        out = x @ weight.T
        return out if bias is None else out + bias

    @abstractmethod
    def embedding(self, token_ids: Array, table: Array) -> Array:
        """``table[token_ids]``: ``[T]`` int32, ``[V, H]`` -> ``[T, H]``."""

    @abstractmethod
    def rms_norm(
        self, x: Array, weight: Array, eps: float, residual: Array | None = None
    ) -> tuple[Array, Array | None]:
        """RMSNorm over the last axis; with ``residual`` fused add first, returns the new stream."""

    @abstractmethod
    def rope(
        self, q: Array, k: Array, positions: Array, cos_sin_cache: Array
    ) -> tuple[Array, Array]:
        """NeoX rotary embedding of ``q[T, Hq, D]`` and ``k[T, Hkv, D]`` at ``positions[T]``."""

    @abstractmethod
    def silu_and_mul(self, x: Array) -> Array:
        """``[T, 2I]`` = [gate | up] -> ``silu(gate) * up`` ``[T, I]``."""

    @abstractmethod
    def write_kv(
        self, kv_cache: Array, layer: int, k: Array, v: Array, slot_mapping: Array
    ) -> None:
        """Scatter ``k``/``v[T, Hkv, D]`` into ``kv_cache`` slots of ``layer``, in place."""

    def qkv_prepare(
        self, qkv: Array, num_q_heads: int, num_kv_heads: int, q_norm: Array | None,
        k_norm: Array | None, eps: float, positions: Array, cos_sin_cache: Array,
        kv_cache: Array, layer: int, slot_mapping: Array,
    ) -> Array:
        """Fused projection ``qkv[T, (Hq + 2 Hkv) D]`` -> rotated q ``[T, Hq, D]``, with k and v
        written to their slots (q/k RMSNorm first when the weights are given). This default
        composes ``rms_norm``, ``rope`` and ``write_kv``; a backend may fuse them."""
        num_tokens = qkv.shape[0]
        head_dim = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
        q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :q_size].reshape(num_tokens, num_q_heads, head_dim)
        k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size:].reshape(num_tokens, num_kv_heads, head_dim)
        if q_norm is not None:
            q, _ = self.rms_norm(q, q_norm, eps)
            k, _ = self.rms_norm(k, k_norm, eps)
        q, k = self.rope(q, k, positions, cos_sin_cache)
        self.write_kv(kv_cache, layer, k, v, slot_mapping)
        return q

    @abstractmethod
    def paged_attention_prefill(
        self,
        q: Array,
        kv_cache: Array,
        layer: int,
        block_tables: Array,
        cu_seqlens_q: Array,
        context_lens: Array,
        scale: float,
        max_query_len: int | None = None,
        max_context_len: int | None = None,
    ) -> Array:
        """Causal varlen GQA attention over paged K/V (prefix included) -> ``[T, Hq, D]``.
        ``max_query_len`` / ``max_context_len``: the most query rows / context tokens of one
        sequence, when the host knows them (they size library graphs; None: unknown)."""

    @abstractmethod
    def paged_attention_decode(
        self,
        q: Array,
        kv_cache: Array,
        layer: int,
        block_tables: Array,
        context_lens: Array,
        scale: float,
    ) -> Array:
        """One query per sequence over its whole paged context -> ``[B, Hq, D]``."""

    @abstractmethod
    def argmax(self, logits: Array) -> Array:
        """Greedy ids of ``logits[B, V]`` -> int32 ``[B]`` (first maximum)."""

    @abstractmethod
    def sampling_probs(
        self, logits: Array, temperatures: Array, top_ks: Array, top_ps: Array
    ) -> Array:
        """Temperature softmax, then top-k, then top-p, renormalized -> float32 ``[B, V]``."""

    @abstractmethod
    def sample_from_probs(self, probs: Array, uniforms: Array) -> Array:
        """Inverse-CDF draw of one id per row with host-drawn ``uniforms[B]`` -> int32 ``[B]``."""

    @abstractmethod
    def apply_token_bitmask(self, logits: Array, bitmask: Array, rows: Array) -> None:
        """Grammar masks, in place: ``logits[rows[r], v] = -inf`` where bit ``v`` of
        ``bitmask[r]`` (int32 ``[R, ceil(V / 32)]``) is 0; other rows untouched."""
