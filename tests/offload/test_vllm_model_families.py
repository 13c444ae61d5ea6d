"""Which of vLLM's KV cache specs the connector serves (vLLM's own spec classes, no vLLM
started), the KV format each puts in the namespace, and how tensor and pipeline parallel
workers split a block into shards."""

from __future__ import annotations

import pytest
import torch

from offload.vllm.kv_shards import kv_shard, num_kv_shards
from offload.vllm.model_identity import kv_signature, spec_kind

kv = pytest.importorskip("vllm.v1.kv_cache_interface")


def _attention(cls, **extra):
    return cls(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32, **extra)


def test_full_sliding_and_mla_specs_are_served_with_their_own_kv_format() -> None:
    full = _attention(kv.FullAttentionSpec)
    promoted = _attention(kv.FullAttentionSpec, sliding_window=48)  # HMA off: all blocks kept
    mla = kv.MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576,
                              dtype=torch.bfloat16)
    assert [spec_kind(s) for s in (full, promoted, mla)] == ["full", "sliding", "mla"]
    # Plain full attention keeps the format (and so the keys) it always had.
    assert kv_signature("cpu", "default", full) == "cpu:default:kvheads2:head32/32"
    assert kv_signature("cpu", "default", promoted) == "cpu:default:kvheads2:head32/32:sw48"
    assert kv_signature("cuda", "NHD", mla) == "cuda:NHD:kvheads1:head576/0:mla"  # no V


@pytest.mark.parametrize("spec, reason", [
    (lambda: _attention(kv.SlidingWindowSpec, sliding_window=48), "every layer slides"),
    (lambda: _attention(kv.ChunkedLocalAttentionSpec, attention_chunk_size=64),
     "outside the chunk"),
    (lambda: kv.MambaSpec(block_size=128, shapes=((4, 4),), dtypes=(torch.float32,)),
     "recurrent state"),
    (lambda: _attention(kv.CrossAttentionSpec), "unchecked"),
])
def test_other_specs_are_refused_with_a_one_line_reason(spec, reason) -> None:
    with pytest.raises(ValueError, match=reason) as info:
        spec_kind(spec())
    assert "\n" not in str(info.value)


def test_each_stage_and_rank_has_its_own_shard_and_mla_ranks_share_theirs() -> None:
    # Two stages of two tensor-parallel ranks: four shards, stage-major; rank (0, 0) reports.
    shards = {(pp, tp): kv_shard(tp, 2, pp, 2, replicated_over_tp=False)
              for pp in range(2) for tp in range(2)}
    assert [shards[pp, tp].shard for pp in range(2) for tp in range(2)] == [0, 1, 2, 3]
    assert {s.num_shards for s in shards.values()} == {4} == {num_kv_shards(2, 2, False)}
    assert [k for k, s in shards.items() if s.reports] == [(0, 0)]
    # MLA's latent cache is the same on every tensor-parallel rank: one shard per stage.
    mla = {(pp, tp): kv_shard(tp, 2, pp, 2, replicated_over_tp=True)
           for pp in range(2) for tp in range(2)}
    assert [mla[pp, tp].shard for pp in range(2) for tp in range(2)] == [0, 0, 1, 1]
    assert num_kv_shards(2, 2, True) == 2
    assert num_kv_shards(1, 1, False) == 1  # no parallelism: the plain namespace
    with pytest.raises(ValueError):
        kv_shard(2, 2, 0, 1, False)
