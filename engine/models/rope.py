"""Rotary tables: inverse frequencies (default, linear, llama3 scaling) and the cos/sin cache."""

from __future__ import annotations

import math

import numpy as np

from engine.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 ``[head_dim / 2]``, computed in float32 as HF transformers does."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(rope.theta), exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short kept, smooth between."""
    if rope.original_max_position_embeddings is None:
        raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
    old_len = float(rope.original_max_position_embeddings)
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = (2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def cos_sin_cache(rope: RopeConfig, head_dim: int, num_positions: int) -> np.ndarray:
    """float32 ``[num_positions, head_dim]``: cos in the first half, sin in the second."""
    inv_freq = inverse_frequencies(rope, head_dim)
    angles = np.arange(num_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)
