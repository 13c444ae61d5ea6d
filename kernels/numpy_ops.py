"""The CPU backend: float32 NumPy arrays, every kernel straight from ``kernels/reference.py``."""

from __future__ import annotations

import numpy as np

from kernels import reference
from kernels.ops import Ops


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32: bf16 is the top half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class NumpyOps(Ops):
    """Float32 activations, weights and KV on the host."""

    name = "numpy"
    xp = np
    act_dtype = np.float32
    kv_dtype = "float32"

    def weight_from_host(self, raw: np.ndarray, dtype: str) -> np.ndarray:
        if dtype == "bfloat16":
            return bf16_bits_to_float32(raw.view(np.uint16))
        if dtype in ("float32", "float16"):
            return np.array(raw, dtype=np.float32)  # a copy: never a view of the mapped file
        raise ValueError(f"unsupported weight dtype {dtype!r}")

    def to_device(self, host: np.ndarray) -> np.ndarray:
        return host

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    embedding = staticmethod(reference.embedding)
    rms_norm = staticmethod(reference.rms_norm)
    rope = staticmethod(reference.rope)
    silu_and_mul = staticmethod(reference.silu_and_mul)
    write_kv = staticmethod(reference.write_kv)
    def paged_attention_prefill(self, q, kv_cache, layer, block_tables, cu_seqlens_q,
                                context_lens, scale, max_query_len=None, max_context_len=None):
        return reference.paged_attention_prefill(q, kv_cache, layer, block_tables, cu_seqlens_q,
                                                 context_lens, scale)

    paged_attention_decode = staticmethod(reference.paged_attention_decode)
    argmax = staticmethod(reference.argmax)
    sampling_probs = staticmethod(reference.sampling_probs)
    sample_from_probs = staticmethod(reference.sample_from_probs)
    apply_token_bitmask = staticmethod(reference.apply_token_bitmask)
