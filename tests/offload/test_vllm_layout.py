"""The vLLM connector's core without vLLM or a daemon: tensor regions, keys, plans, settings."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvstore.keys import ModelIdentity, Namespace
from offload.core.states import IllegalTransition
from offload.external.block_keys import KeyMaker
from offload.external.plan import BlockTransfer
from offload.external.tensor_layout import TensorSpec, layout_signature, name_dims, regions_of
from offload.store_client import StoreClient
from offload.vllm.model_identity import kv_format, vllm_identity
from offload.vllm.scheduler_side import ScheduledRequest, SchedulerSide
from offload.vllm.settings import ConnectorSettings
from offload.vllm.tracked_request import LoadState, TrackedRequest


def _spec_of(arr: np.ndarray, block_dim: int, name: str = "layer") -> TensorSpec:
    names = tuple("blocks" if d == block_dim else f"d{d}" for d in range(arr.ndim))
    return TensorSpec(name, arr.shape, tuple(s // arr.itemsize for s in arr.strides),
                      arr.itemsize, names, 0, arr.nbytes)


def _block_bytes(arr: np.ndarray, spec: TensorSpec, block_id: int) -> bytes:
    """A block as the store keeps it: the pieces of ``regions_of`` concatenated."""
    raw = np.frombuffer(arr.data if arr.flags.c_contiguous else arr.copy().data, np.uint8)
    return b"".join(raw[p.offset + block_id * p.block_stride:
                        p.offset + block_id * p.block_stride + p.block_bytes].tobytes()
                    for p in regions_of(spec))


def test_cpu_backend_layout_is_one_region_per_layer() -> None:
    # vLLM's CPU backend: [num_blocks, kv_heads, block_size, 2 * head_dim]
    kv = np.arange(6 * 2 * 4 * 8, dtype=np.float32).reshape(6, 2, 4, 8)
    spec = _spec_of(kv, 0)
    pieces = regions_of(spec)
    assert len(pieces) == 1
    assert pieces[0].block_bytes == 2 * 4 * 8 * 4 == pieces[0].block_stride
    for b in range(6):
        assert _block_bytes(kv, spec, b) == kv[b].tobytes()


def test_flash_layout_gives_a_k_and_a_v_region() -> None:
    # flash attention: [2, num_blocks, block_size, kv_heads, head_dim]
    kv = np.random.default_rng(0).standard_normal((2, 5, 4, 2, 8)).astype(np.float16)
    spec = _spec_of(kv, 1)
    pieces = regions_of(spec)
    assert [p.offset for p in pieces] == [0, 5 * 4 * 2 * 8 * 2]
    for b in range(5):
        assert _block_bytes(kv, spec, b) == kv[0, b].tobytes() + kv[1, b].tobytes()
    assert layout_signature(spec) == "d0=2|d2=4.d3=2.d4=8"  # name+size, outer|piece


def test_permuted_strides_are_read_from_the_tensor_not_assumed() -> None:
    # Logical [num_blocks, block_size, kv_heads, dim] stored heads-major inside each block.
    phys = np.arange(3 * 2 * 4 * 8, dtype=np.int32).reshape(3, 2, 4, 8)  # [B, H, N, D]
    logical = phys.transpose(0, 2, 1, 3)  # [B, N, H, D] view with permuted strides
    spec = _spec_of(logical, 0)
    (piece,) = regions_of(spec)
    assert piece.block_bytes == 2 * 4 * 8 * 4
    assert _block_bytes(phys, spec, 2) == phys[2].tobytes()
    assert layout_signature(spec) != layout_signature(_spec_of(phys, 0))


def test_a_block_piece_that_is_not_contiguous_is_refused() -> None:
    kv = np.zeros((4, 6, 8), dtype=np.float32)[:, :, :4]  # padded inner dim
    with pytest.raises(ValueError, match="not contiguous"):
        regions_of(_spec_of(kv, 0))


def test_a_buffer_too_small_is_refused() -> None:
    kv = np.zeros((4, 2, 8), dtype=np.float32)
    spec = _spec_of(kv, 0)
    small = TensorSpec("x", spec.shape, spec.strides, 4, spec.dim_names, 0, kv.nbytes - 4)
    with pytest.raises(ValueError, match="past its buffer"):
        regions_of(small)


def test_block_dim_is_found_or_the_ambiguity_reported() -> None:
    assert name_dims((2, 100, 16, 2, 32), (102400, 1024, 64, 32, 1), 100)[1] == "blocks"
    # 16 blocks of 16 tokens: the blocks are the outer of the two.
    assert name_dims((2, 16, 16, 8, 128), (262144, 16384, 1024, 128, 1), 16)[1] == "blocks"
    with pytest.raises(ValueError, match="cannot tell"):
        name_dims((16, 16, 32), (0, 0, 1), 16)
    with pytest.raises(ValueError, match="cannot tell"):
        name_dims((8, 32), (32, 1), 16)


def _identity(**overrides) -> ModelIdentity:
    base = dict(architecture="Qwen3ForCausalLM", num_layers=2, num_kv_heads=2, head_dim=32,
                kv_dtype="bfloat16", block_size=4, weights_id="w", kv_format="cpu:LBHNC")
    return vllm_identity(**{**base, **overrides})


def test_namespaces_separate_salts_loras_layouts_and_kvengine() -> None:
    keys = KeyMaker(_identity())
    base = keys.namespace(None, None)
    assert keys.namespace("alice", None) not in (base, keys.namespace("bob", None))
    assert keys.namespace(None, "alice") != keys.namespace("alice", None)
    assert KeyMaker(_identity(kv_format="cuda:LBNHC")).namespace(None, None) != base
    assert KeyMaker(_identity(block_size=8)).namespace(None, None) != base
    kvengine = Namespace(model=replace(_identity(), architecture="Qwen3ForCausalLM")).digest
    assert kvengine != base  # the same model's blocks in kvengine


def test_a_vllm_namespace_is_kvengines_identity_with_the_kv_format_in_its_architecture(
        ) -> None:
    """What every block a vLLM instance stored is found by: a changed derivation would make
    every block already in a store a miss."""
    identity = ModelIdentity("vllm:Qwen3ForCausalLM|cpu:LBHNC", 2, 2, 32, "bfloat16", 4, "w")
    assert _identity() == identity and kv_format(identity) == "cpu:LBHNC"
    keys = KeyMaker(_identity())
    assert keys.namespace("alice", "l:1") == Namespace(model=identity, tenant_salt="alice",
                                                        lora_id="l:1").digest
    keys.reset()  # vLLM's cache reset: the weights are named anew
    assert keys.namespace(None, None) == Namespace(
        model=replace(identity, weights_id="w#reset1")).digest


def test_keys_chain_over_vllms_block_size() -> None:
    keys = KeyMaker(_identity())
    a = keys.keys(list(range(10)))
    assert a.num_blocks == 2  # 10 tokens, blocks of 4
    b = keys.keys(list(range(10)) + [99, 98])
    assert b.hashes[:2] == a.hashes and len(b.hashes) == 3
    c = keys.keys([0, 1, 2, 3, 9, 9, 9, 9])
    assert c.hashes[0] == a.hashes[0] and c.hashes[1] != a.hashes[1]
    assert a.idents[1].startswith(a.hashes[0])  # the parent is part of what a hit verifies


def test_plan_saves_each_full_block_once_past_vllms_own_hit(tmp_path) -> None:
    client = StoreClient(tmp_path / "nobody.sock", None, "sched", timeout_s=0.2,
                         reconnect_interval_s=60)
    side = SchedulerSide(KeyMaker(_identity()), client, max_load_blocks=8, lookup_timeout_s=0.2)
    tokens = list(range(100, 114))  # 3 full blocks of 4 and 2 tokens
    assert side.match("r", tokens, 4, None, None) == 0  # no daemon: a miss, not an error
    side.after_alloc("r", [7, 8, 9, 10], 0)
    plan = side.plan_step([ScheduledRequest("r", 4, 6, None)])
    assert not plan.loads
    (save,) = plan.saves
    assert save.block_ids == [8]  # block 0 was vLLM's hit; tokens 4..9 complete block 1
    plan = side.plan_step([ScheduledRequest("r", 10, 4, [11])])
    assert [s.block_ids for s in plan.saves] == [[9]]
    assert side.plan_step([ScheduledRequest("r", 14, 1, None)]).saves == []
    side.finished("r")
    assert side.num_tracked == 0
    client.close()


def test_a_request_loads_only_what_a_lookup_hit_and_only_once() -> None:
    """The load states' table: no load without a hit, no second hit while a load is in
    flight (vLLM never asks about such a request), and a finished load lets it be asked
    again (a preempted request)."""
    tracked = TrackedRequest([1, 2, 3], None, None)
    with pytest.raises(IllegalTransition):
        tracked.to(LoadState.LOADING)
    for state in (LoadState.HIT, LoadState.LOADING):
        tracked.to(state)
    with pytest.raises(IllegalTransition):
        tracked.to(LoadState.HIT)
    tracked.to(LoadState.IDLE)
    tracked.to(LoadState.HIT)
    assert str(tracked.state) == "hit" and tracked.num_loading_blocks == 0


def test_transfers_check_lengths_and_chunk() -> None:
    with pytest.raises(ValueError):
        BlockTransfer("r", [1, 2], b"n" * 16, [b"h" * 16], [b"i"])
    t = BlockTransfer("r", list(range(5)), b"n" * 16, [b"h" * 16] * 5, [b"i"] * 5)
    assert [c.block_ids for c in t.chunks(2)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="at least 1"):  # never an empty plan that saves nothing
        t.chunks(0)


def test_settings_refuse_unknown_keys_and_bad_values() -> None:
    s = ConnectorSettings.from_extra_config({"kv_store_socket": "/x.sock", "load_blocks": 8,
                                             "lookup_timeout_s": "0.5"})
    assert (s.kv_store_socket, s.load_blocks, s.lookup_timeout_s) == ("/x.sock", 8, 0.5)
    with pytest.raises(ValueError, match="unknown"):
        ConnectorSettings.from_extra_config({"kv_store_sockett": "/x"})
    with pytest.raises(ValueError, match="load_blocks"):
        ConnectorSettings.from_extra_config({"load_blocks": 1.5})
    with pytest.raises(ValueError, match="positive"):
        ConnectorSettings.from_extra_config({"lookup_timeout_s": 0})
