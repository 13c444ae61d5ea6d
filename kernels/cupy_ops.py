"""The CUDA backend: bf16 weights, activations and KV on the GPU, float32 accumulation.

Every kernel is a ``.cu`` file compiled by CuPy (NVRTC) behind a launcher that checks shapes and
dtypes (``kernels/<name>.py``; index in ``KERNELS.md``). GEMMs call cuBLAS directly
(``kernels/cublas_gemm.py``: bf16 in, float32 accumulate), so decode steps can be captured into
CUDA graphs (``kernels/cuda_graph.py``). Imported only when the device is "cuda": the CPU path
never loads CuPy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import cupy as cp
import ml_dtypes
import numpy as np

from kernels import (
    activation,
    attention,
    embedding,
    plan_builder,
    qkv_prepare,
    rms_norm,
    rope,
    sampling,
    token_bitmask,
    write_kv,
)
from kernels.attention_backends import wanted_backends
from kernels.build_log import CUDA_GRAPH
from kernels.cublas_gemm import CublasGemm
from kernels.cuda_module import BF16, contiguous, watch
from kernels.cudnn_attention import CudnnAttention, CudnnUnavailable
from kernels.kernel_warm_up import warm_kernels
from kernels.ops import CapturedGraph, Ops
from kernels.pinned_upload import PinnedUpload, UploadFailed
from kernels.plan_cache import PlanCache, default_directory

log = logging.getLogger("kernels.cupy_ops")


class CupyOps(Ops):
    """bf16 storage on the current CUDA device; kernels from ``kernels/*.cu``."""

    name = "cupy"
    act_dtype = ml_dtypes.bfloat16
    kv_dtype = "bfloat16"

    supports_graphs = True

    def __init__(self) -> None:
        self.xp = cp
        self.device_id = cp.cuda.Device().id
        self._capturer = None  # created on the first capture: most CPU-free tests never need it
        self._upload: PinnedUpload | None = None  # weights on their way to the device
        self._weights_upload_s: float | None = None
        self._upload_failed: UploadFailed | None = None
        self._gemm = CublasGemm()
        watch(self.builds)  # a kernel module compiled after ready is a first-use cost
        self.attention_backends = wanted_backends()
        self.attention_note = ""  # why cuDNN is not used, when it is not
        self.num_attention_fallbacks = 0  # calls cuDNN refused, served by our kernels
        self._cudnn: CudnnAttention | None = None
        if "cudnn" in self.attention_backends.values():
            try:
                builder = plan_builder.PlanBuilder(self.device_id) \
                    if plan_builder.wanted() else None
                self._cudnn = CudnnAttention(self.builds, PlanCache(default_directory()),
                                             builder)
                self.attention_note = f"cuDNN {self._cudnn.version}"
            except CudnnUnavailable as exc:  # no frontend or no libcudnn: our kernels serve all
                self.attention_backends = {phase: "ours" for phase in self.attention_backends}
                self.attention_note = str(exc)
                # a degraded engine says so where operators look: an H200 run without the
                # frontend served agent turns' first tokens 1.5-1.7x later and each next token
                # 1.2x later (README, s21), and said so only at info
                log.warning("cuDNN is not available (%s): our kernels serve every attention "
                            "phase, slower than cuDNN's; install the cuDNN frontend, or set "
                            "KVSTORE_ATTENTION=ours to choose this", exc)

    def close(self) -> None:
        upload, self._upload = self._upload, None
        if upload is not None:  # a load or warm-up that failed: no copy outlives the engine
            upload.close()
        if self._cudnn is not None:
            self._cudnn.close()

    def preload_attention_plans(self, scope: tuple) -> int:
        return self._cudnn.plans.preload(scope) if self._cudnn is not None else 0

    def warm_kernels(self, num_q_heads, num_kv_heads, head_dim, block_size, vocab_size):
        warm_kernels(num_q_heads, num_kv_heads, head_dim, block_size, vocab_size)

    @property
    def allocator_bytes(self) -> dict[str, int]:
        with cp.cuda.Device(self.device_id):  # the pool of this engine's device, from any thread
            pool = cp.get_default_memory_pool()
            return {"held": pool.total_bytes(), "in_use": pool.used_bytes()}

    @property
    def background_builds(self) -> dict[str, int]:
        builder = self._cudnn.plans.background if self._cudnn is not None else None
        return {outcome.value: n for outcome, n in builder.counts.items()} \
            if builder is not None else {}

    def load_built_plans(self, nobody_waits: Callable[[], bool]) -> int:
        return self._cudnn.plans.load_built(nobody_waits) if self._cudnn is not None else 0

    @property
    def attention_backend(self) -> str:
        line = super().attention_backend
        if self._cudnn is not None and self._cudnn.split is not None and \
                self.attention_backends["prefill"] == "cudnn":
            # short queries over long contexts split the context (kernels/cudnn_split.py)
            line = line.replace("prefill=cudnn", "prefill=cudnn+split", 1)
        return f"{line} ({self.attention_note})" if self.attention_note else line

    @property
    def num_attention_graphs(self) -> int:
        return self._cudnn.num_graphs if self._cudnn is not None else 0

    def capture_graph(self, fn, key: object = None) -> CapturedGraph:
        from kernels.cuda_graph import GraphCapturer

        if self._capturer is None:
            self._capturer = GraphCapturer()
        with self.builds.building(CUDA_GRAPH, key):
            return self._capturer.capture(fn)

    # -- transfers ---------------------------------------------------------------------------

    def weight_from_host(self, raw: np.ndarray, dtype: str) -> cp.ndarray:
        return self._weights().upload(_bf16_host(raw, dtype))

    def stacked_weight_from_host(self, parts: list[tuple[np.ndarray, str]]) -> cp.ndarray:
        return self._weights().upload_stacked([_bf16_host(raw, dtype) for raw, dtype in parts])

    def _weights(self) -> PinnedUpload:
        if self._upload is None:  # the first weight of a load: staged until weights_ready
            self._upload = PinnedUpload()
        return self._upload

    def weights_loaded(self) -> None:
        if self._upload is not None:
            self._upload.start()  # beside the warm-up: captures need addresses, not values

    def weights_ready(self) -> None:
        if self._upload_failed is not None:  # every later call too: never serve without them
            raise self._upload_failed
        upload, self._upload = self._upload, None
        if upload is not None:
            try:
                upload.finish()
            except UploadFailed as exc:
                self._upload_failed = exc
                raise
            self._weights_upload_s = upload.seconds

    @property
    def weights_upload_s(self) -> float | None:
        return self._weights_upload_s

    def work_done_marker(self) -> Callable[[], bool]:
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record()  # on the current stream, after everything queued on it so far
        return lambda: event.done

    def to_device(self, host: np.ndarray) -> cp.ndarray:
        return cp.asarray(host)

    def to_host(self, x: cp.ndarray) -> np.ndarray:
        return cp.asnumpy(x)

    # -- kernels -----------------------------------------------------------------------------

    def linear(self, x: cp.ndarray, weight: cp.ndarray, bias: cp.ndarray | None = None):
        out = self._gemm(contiguous(x), weight)
        return out if bias is None else activation.add_bias_(out, bias)

    def embedding(self, token_ids, table):
        return embedding.embedding(token_ids, table)

    def rms_norm(self, x, weight, eps, residual=None):
        return rms_norm.rms_norm(x, weight, eps, residual)

    def rope(self, q, k, positions, cos_sin_cache):
        return rope.rope(q, k, positions, cos_sin_cache)

    def silu_and_mul(self, x):
        return activation.silu_and_mul(x)

    def write_kv(self, kv_cache, layer, k, v, slot_mapping):
        write_kv.write_kv(kv_cache, layer, k, v, slot_mapping)

    def qkv_prepare(self, qkv, num_q_heads, num_kv_heads, q_norm, k_norm, eps, positions,
                    cos_sin_cache, kv_cache, layer, slot_mapping):
        return qkv_prepare.qkv_prepare(qkv, num_q_heads, num_kv_heads, q_norm, k_norm, eps,
                                       positions, cos_sin_cache, kv_cache, layer, slot_mapping)

    def paged_attention_prefill(self, q, kv_cache, layer, block_tables, cu_seqlens_q,
                                context_lens, scale, max_query_len=None, max_context_len=None):
        if self._cudnn is not None and self.attention_backends["prefill"] == "cudnn":
            out = self._cudnn.run_prefill(q, kv_cache, layer, block_tables, cu_seqlens_q,
                                          context_lens, scale, max_query_len, max_context_len)
            if out is not None:
                return out
            self.num_attention_fallbacks += 1
        return attention.paged_attention_prefill(q, kv_cache, layer, block_tables, cu_seqlens_q,
                                                 context_lens, scale)

    def paged_attention_decode(self, q, kv_cache, layer, block_tables, context_lens, scale):
        if self._cudnn is not None and self.attention_backends["decode"] == "cudnn":
            out = self._cudnn.run_decode(q, kv_cache, layer, block_tables, context_lens, scale)
            if out is not None:
                return out
            self.num_attention_fallbacks += 1
        return attention.paged_attention_decode(q, kv_cache, layer, block_tables, context_lens,
                                                scale)

    def argmax(self, logits):
        return sampling.argmax(logits)

    def sampling_probs(self, logits, temperatures, top_ks, top_ps):
        return sampling.sampling_probs(logits, temperatures, top_ks, top_ps)

    def sample_from_probs(self, probs, uniforms):
        return sampling.sample_from_probs(probs, uniforms)

    def apply_token_bitmask(self, logits, bitmask, rows):
        token_bitmask.apply_token_bitmask(logits, bitmask, rows)


def _bf16_host(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A checkpoint tensor's values as a host bf16 array (float32/float16 rounded to nearest
    even, as torch does; bf16 bits taken as they are)."""
    if dtype == "bfloat16":
        return np.ascontiguousarray(raw).view(np.uint16).view(BF16)
    if dtype in ("float32", "float16"):
        return np.asarray(raw).astype(BF16)
    raise ValueError(f"unsupported weight dtype {dtype!r}")
