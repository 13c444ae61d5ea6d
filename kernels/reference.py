"""NumPy reference of every kernel the model calls: the CPU backend runs these, GPU tests compare.

Contracts shared by all ops (the CUDA launchers must honour them too):

- ``T`` is the number of tokens in a step (all sequences concatenated), ``B`` the number of
  sequences, ``H`` hidden size, ``Hq``/``Hkv`` query/KV heads (``Hq % Hkv == 0``, GQA), ``D`` head
  dim, ``V`` vocab size, ``I`` MLP intermediate size.
- Index arrays (token ids, positions, slot mappings, block tables, lengths) are int32.
- Activations have the backend's activation dtype (float32 here); every reduction (norm variance,
  softmax, attention scores) is accumulated in float32.
- The KV arena is block-major: ``kv_cache[num_blocks, num_layers, 2, block_size, Hkv, D]`` with
  index 0 = K and 1 = V on the third axis. A *slot* is ``block_id * block_size + offset``.
- A block table row lists a sequence's block ids in order; entries past
  ``ceil(context_len / block_size)`` are padding and never read (padded with 0, a valid id).
"""

from __future__ import annotations

import numpy as np

_QUERY_CHUNK = 256


def embedding(token_ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Rows of ``table[V, H]`` for ``token_ids[T]`` -> ``[T, H]`` in the table's dtype."""
    return table[token_ids]


def rms_norm(
    x: np.ndarray, weight: np.ndarray, eps: float, residual: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """RMSNorm over the last axis, optionally fused with the residual add.

    ``x[..., H]``, ``weight[H]``. Without ``residual``: returns ``(norm(x) * weight, None)``. With
    ``residual`` (same shape as ``x``): ``s = x + residual`` and returns ``(norm(s) * weight, s)``,
    the new residual stream. ``norm(s) = s / sqrt(mean(s**2) + eps)`` in float32.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.astype(np.float32, copy=False)
    variance = np.mean(xf * xf, axis=-1, keepdims=True)
    normed = (xf * (1.0 / np.sqrt(variance + np.float32(eps)))).astype(x.dtype, copy=False)
    return weight * normed, residual


def rope(
    q: np.ndarray, k: np.ndarray, positions: np.ndarray, cos_sin_cache: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rotary embedding, NeoX style (rotate the two halves of each head), on q and k.

    ``q[T, Hq, D]``, ``k[T, Hkv, D]``, ``positions[T]``; ``cos_sin_cache[max_positions, D]``
    float32 with ``cos(pos * inv_freq)`` in ``[:, :D/2]`` and ``sin`` in ``[:, D/2:]``. For each
    head ``x = (x1, x2)``: ``(x1 cos - x2 sin, x2 cos + x1 sin)``. Returns new arrays.
    """
    half = q.shape[-1] // 2
    table = cos_sin_cache[positions]
    cos = table[:, None, :half]
    sin = table[:, None, half:]

    def rotate(x: np.ndarray) -> np.ndarray:
        x1, x2 = x[..., :half], x[..., half:]
        out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(x.dtype, copy=False)

    return rotate(q), rotate(k)


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    """``x[T, 2I]`` = [gate | up] -> ``silu(gate) * up`` of shape ``[T, I]``."""
    width = x.shape[-1] // 2
    gate, up = x[..., :width], x[..., width:]
    with np.errstate(over="ignore"):  # exp(-gate) overflows to inf for gate << 0: silu -> -0
        silu = gate / (1.0 + np.exp(-gate))
    return (silu * up).astype(x.dtype, copy=False)


def write_kv(
    kv_cache: np.ndarray, layer: int, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray
) -> None:
    """Scatter this step's ``k[T, Hkv, D]`` and ``v`` into their slots of ``layer``, in place.

    ``slot_mapping[T]``: token ``t`` goes to block ``slot // block_size``, offset
    ``slot % block_size``. Slots are distinct within a call; a negative slot (a padding row of a
    graph bucket) writes nothing.
    """
    block_size = kv_cache.shape[3]
    keep = slot_mapping >= 0
    block_ids = slot_mapping[keep] // block_size
    offsets = slot_mapping[keep] % block_size
    kv_cache[block_ids, layer, 0, offsets] = k[keep]
    kv_cache[block_ids, layer, 1, offsets] = v[keep]


def qkv_prepare(
    qkv: np.ndarray, num_q_heads: int, num_kv_heads: int, q_norm: np.ndarray | None,
    k_norm: np.ndarray | None, eps: float, positions: np.ndarray, cos_sin_cache: np.ndarray,
    kv_cache: np.ndarray, layer: int, slot_mapping: np.ndarray,
) -> np.ndarray:
    """The attention inputs of a step from the fused projection ``qkv[T, (Hq + 2 Hkv) * D]``.

    Splits it into q/k/v heads; with ``q_norm``/``k_norm`` (``[D]``, Qwen3) RMS-normalizes every
    q and k head (``rms_norm``); rotates q and k (``rope``); writes k and v into their slots of
    ``layer`` (``write_kv``; a negative slot writes nothing); returns q ``[T, Hq, D]``. This is the
    composition of those references; a fused kernel rounds once, at the end.
    """
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    heads = qkv.reshape(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim)
    q = heads[:, :num_q_heads]
    k = heads[:, num_q_heads:num_q_heads + num_kv_heads]
    v = heads[:, num_q_heads + num_kv_heads:]
    if q_norm is not None:
        q, _ = rms_norm(q, q_norm, eps)
        k, _ = rms_norm(k, k_norm, eps)
    q, k = rope(q, k, positions, cos_sin_cache)
    keep = slot_mapping >= 0
    write_kv(kv_cache, layer, k[keep], v[keep], slot_mapping[keep])
    return q


def gather_kv(
    kv_cache: np.ndarray, layer: int, block_table: np.ndarray, context_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[context_len, Hkv, D]`` of one sequence, read through its block table row."""
    block_size = kv_cache.shape[3]
    num_blocks = -(-context_len // block_size)
    blocks = kv_cache[block_table[:num_blocks], layer]  # [n, 2, block_size, Hkv, D]
    k = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:context_len]
    v = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:context_len]
    return k, v


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal GQA attention of ``q[n, Hq, D]``, the last n positions of ``k``/``v[L, Hkv, D]``."""
    num_queries, num_q_heads, head_dim = q.shape
    context_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    # [Hkv, group, n, D] @ [Hkv, 1, D, L] -> scores [Hkv, group, n, L] (batched GEMMs)
    qf = q.astype(np.float32).reshape(num_queries, num_kv_heads, group, head_dim)
    qf = qf.transpose(1, 2, 0, 3)
    kf = k.astype(np.float32).transpose(1, 2, 0)[:, None]
    vf = v.astype(np.float32).transpose(1, 0, 2)[:, None]
    scores = (qf @ kf) * np.float32(scale)
    query_pos = np.arange(context_len - num_queries, context_len)[:, None]
    key_pos = np.arange(context_len)[None, :]
    scores = np.where(key_pos <= query_pos, scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = (probs @ vf).transpose(2, 0, 1, 3)  # [n, Hkv, group, D]
    return out.reshape(num_queries, num_q_heads, head_dim).astype(q.dtype, copy=False)


def paged_attention_prefill(
    q: np.ndarray,
    kv_cache: np.ndarray,
    layer: int,
    block_tables: np.ndarray,
    cu_seqlens_q: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
) -> np.ndarray:
    """Causal attention for a variable-length batch whose K/V (prefix included) sit in blocks.

    ``q[T, Hq, D]``: sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (``q_len``
    rows). ``context_lens[B]``: tokens of ``b`` already in the cache *including* this step's (so
    ``write_kv`` ran first); query row ``i`` of ``b`` sits at position
    ``context_lens[b] - q_len + i`` and attends keys ``0..position``. ``block_tables[B, M]``.
    Returns ``[T, Hq, D]``. ``q_len`` may be 1 (decode rows mixed into a prefill batch).
    """
    out = np.empty_like(q)
    for b in range(len(context_lens)):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        context_len = int(context_lens[b])
        k, v = gather_kv(kv_cache, layer, block_tables[b], context_len)
        # Query chunks bound the score matrix (Hq x chunk x context) for long prompts.
        for chunk in range(start, end, _QUERY_CHUNK):
            chunk_end = min(chunk + _QUERY_CHUNK, end)
            visible = context_len - (end - chunk_end)  # keys up to the chunk's last position
            out[chunk:chunk_end] = _attend(q[chunk:chunk_end], k[:visible], v[:visible], scale)
    return out


def paged_attention_decode(
    q: np.ndarray,
    kv_cache: np.ndarray,
    layer: int,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
) -> np.ndarray:
    """One query per sequence: ``q[B, Hq, D]`` attends all ``context_lens[b]`` cached tokens.

    The same as ``paged_attention_prefill`` with ``q_len = 1`` for every sequence; a separate op
    because the GPU kernel for it is shaped differently (split over the context, not the queries).
    """
    out = np.empty_like(q)
    for b in range(len(context_lens)):
        k, v = gather_kv(kv_cache, layer, block_tables[b], int(context_lens[b]))
        out[b : b + 1] = _attend(q[b : b + 1], k, v, scale)
    return out


def argmax(logits: np.ndarray) -> np.ndarray:
    """Greedy ids: ``logits[B, V]`` -> int32 ``[B]``, the first index of each row's maximum."""
    return np.argmax(logits, axis=-1).astype(np.int32)


def sampling_probs(
    logits: np.ndarray, temperatures: np.ndarray, top_ks: np.ndarray, top_ps: np.ndarray
) -> np.ndarray:
    """Filtered, renormalized float32 probabilities ``[B, V]`` to sample from.

    Row ``b``: ``softmax(logits[b] / temperatures[b])`` (``temperatures > 0``), then keep the
    ``top_ks[b]`` most probable tokens (0 = all), then the nucleus: in descending order (ties: lower
    id first) keep a token while the mass of the tokens before it is ``< top_ps[b]`` (1.0 = all).
    At least one token always survives. Dropped tokens get probability exactly 0.
    """
    scaled = logits.astype(np.float32) / temperatures.astype(np.float32)[:, None]
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    vocab = logits.shape[-1]
    ranks = np.arange(vocab)[None, :]
    top_ks = np.where(top_ks > 0, top_ks, vocab)[:, None]
    keep_sorted = ranks < top_ks
    sorted_probs = np.where(keep_sorted, sorted_probs, 0.0)
    mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
    total = sorted_probs.sum(axis=-1, keepdims=True)
    keep_sorted &= mass_before < top_ps.astype(np.float32)[:, None] * total
    keep_sorted[:, 0] = True
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    probs = np.where(keep, probs, 0.0).astype(np.float32)
    return probs / probs.sum(axis=-1, keepdims=True)


def sample_from_probs(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw: for each row the first id whose cumulative mass exceeds ``u * total``.

    ``probs[B, V]`` (non-negative, rows need not sum to 1), ``uniforms[B]`` in ``[0, 1)`` drawn on
    the host from each request's own generator, so a seed fixes the draw on any backend. Ids with
    zero probability are never returned. Returns int32 ``[B]``.
    """
    cdf = np.cumsum(probs.astype(np.float64), axis=-1)
    targets = uniforms.astype(np.float64) * cdf[:, -1]
    ids = np.array([np.searchsorted(row, t, side="right") for row, t in zip(cdf, targets)])
    # u * total can round up to the total: fall back to the last id with mass.
    last_nonzero = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    return np.minimum(ids, last_nonzero).astype(np.int32)


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """Grammar masks, in place: ``logits[rows[r], v] = -inf`` wherever bit ``v % 32`` of
    ``bitmask[r, v // 32]`` is 0 (llguidance's layout: int32 words, token ``32 w + j`` is bit
    ``j`` of word ``w``). ``logits[B, V]`` float32; ``bitmask[R, W]`` int32 with ``32 W >= V``;
    ``rows[R]`` distinct row indices (the constrained rows of a batch: the others are untouched).
    """
    vocab = logits.shape[1]
    words = np.ascontiguousarray(bitmask, dtype="<i4")
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    rows = np.asarray(rows, dtype=np.int64)
    masked = logits[rows]
    masked[allowed == 0] = -np.inf
    logits[rows] = masked
