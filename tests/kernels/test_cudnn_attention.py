"""cuDNN SDPA over the paged arena (kernels/cudnn_attention.py) against the NumPy references and
our kernels, and the backend choice the CUDA ops report.

Inputs are bf16-rounded; the references run in float32 on the rounded values. Contexts are
ragged, blocks shuffled, and queries sit at the end of longer contexts (a cached prefix), so the
page tables, the ragged row offsets and the bottom-right causal mask are all exercised.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kernels import reference as ref

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cudnn_attn():
    from kernels.cudnn_attention import CudnnAttention, CudnnUnavailable

    try:
        return CudnnAttention()
    except CudnnUnavailable as exc:
        pytest.skip(f"cuDNN is not available here: {exc}")


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    got = got.astype(np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def paged_case(rng, bf16, block_size: int, context_lens: list[int], num_kv_heads: int,
               head_dim: int, num_layers: int = 3, spare_width: int = 0):
    """A random bf16 arena and shuffled block tables (``spare_width`` unused columns)."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 5
    kv = rng.standard_normal((num_blocks, num_layers, 2, block_size, num_kv_heads,
                              head_dim)).astype(bf16)
    tables = np.zeros((len(context_lens), max(blocks_per_seq) + spare_width), dtype=np.int32)
    perm = rng.permutation(num_blocks).astype(np.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[start:start + n]
        start += n
    return kv, tables


PREFILL_CASES = [
    # block_size, context_lens, q_lens, Hq, Hkv, D
    (16, [1000], [1000], 32, 8, 128),                     # a cold prompt, Qwen3-4B heads
    (16, [300, 70, 1, 200], [300, 1, 1, 77], 32, 8, 128),  # prefix hits, decode rows mixed in
    (16, [2100, 40], [100, 40], 32, 8, 128),              # a turn over a long cached prefix
    (32, [129, 64], [65, 64], 16, 2, 64),                 # other heads, blocks and head dim
]


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_cudnn_prefill_matches_reference(cp, bf16, cudnn_attn, case, gather: bool) -> None:
    """Both layouts: long queries gathered dense (``gather``) and every shape read paged."""
    from kernels.attention import paged_attention_prefill

    cudnn_attn.gather = gather

    block_size, lens, q_lens, num_q_heads, num_kv_heads, head_dim = case
    rng = np.random.default_rng(11)
    kv, tables = paged_case(rng, bf16, block_size, lens, num_kv_heads, head_dim, spare_width=3)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), num_q_heads, head_dim)).astype(bf16)
    ctx = np.array(lens, dtype=np.int32)
    scale = head_dim ** -0.5
    args = (cp.asarray(q), cp.asarray(kv), 2, cp.asarray(tables), cp.asarray(cu),
            cp.asarray(ctx), scale)
    got = cudnn_attn.run_prefill(*args, max(q_lens))
    assert got is not None, f"cuDNN refused the shape: {cudnn_attn.refusals}"
    want = ref.paged_attention_prefill(q.astype(np.float32), kv.astype(np.float32), 2, tables,
                                       cu, ctx, scale)
    assert rel_err(cp.asnumpy(got), want) < 1e-2
    ours = cp.asnumpy(paged_attention_prefill(*args)).astype(np.float32)
    assert rel_err(cp.asnumpy(got), ours) < 1e-2
    # without the host's row bound the graph is sized by the token count: same result
    again = cudnn_attn.run_prefill(*args)
    assert rel_err(cp.asnumpy(again), want) < 1e-2


DECODE_CASES = [
    (16, [3000], 32, 8, 128),
    (16, [1, 17, 64, 65, 500, 129], 32, 8, 128),
    (16, [5, 40], 8, 2, 64),
]


@pytest.mark.parametrize("case", DECODE_CASES)
def test_cudnn_decode_matches_reference(cp, bf16, cudnn_attn, case) -> None:
    block_size, lens, num_q_heads, num_kv_heads, head_dim = case
    rng = np.random.default_rng(12)
    kv, tables = paged_case(rng, bf16, block_size, lens, num_kv_heads, head_dim)
    q = rng.standard_normal((len(lens), num_q_heads, head_dim)).astype(bf16)
    ctx = np.array(lens, dtype=np.int32)
    got = cudnn_attn.run_decode(cp.asarray(q), cp.asarray(kv), 1, cp.asarray(tables),
                                cp.asarray(ctx), 0.1)
    assert got is not None, f"cuDNN refused the shape: {cudnn_attn.refusals}"
    want = ref.paged_attention_decode(q.astype(np.float32), kv.astype(np.float32), 1, tables,
                                      ctx, 0.1)
    assert rel_err(cp.asnumpy(got), want) < 1e-2


def test_cudnn_graph_serves_every_layer(cp, bf16, cudnn_attn) -> None:
    """One built graph per shape: a second layer reuses it with another arena offset."""
    cudnn_attn.gather = False
    rng = np.random.default_rng(13)
    lens = [333]
    kv, tables = paged_case(rng, bf16, 16, lens, 8, 128)
    q = rng.standard_normal((333, 32, 128)).astype(bf16)
    cu, ctx = np.array([0, 333], dtype=np.int32), np.array(lens, dtype=np.int32)
    dev = (cp.asarray(q), cp.asarray(kv))
    built = cudnn_attn.num_graphs
    for layer in range(3):
        got = cudnn_attn.run_prefill(dev[0], dev[1], layer, cp.asarray(tables), cp.asarray(cu),
                                     cp.asarray(ctx), 0.08, 333)
        want = ref.paged_attention_prefill(q.astype(np.float32), kv.astype(np.float32), layer,
                                           tables, cu, ctx, 0.08)
        assert rel_err(cp.asnumpy(got), want) < 1e-2
    assert cudnn_attn.num_graphs == built + 1


def test_cuda_ops_report_and_honor_the_attention_choice(cp, monkeypatch) -> None:
    from kernels import make_ops

    monkeypatch.setenv("KVSTORE_ATTENTION", "ours")
    ops = make_ops("cuda")
    assert ops.attention_backends == {"prefill": "ours", "decode": "ours"}
    assert ops.attention_backend == "prefill=ours decode=ours"
    monkeypatch.setenv("KVSTORE_ATTENTION", "auto")
    ops = make_ops("cuda")
    assert ops.attention_backends["prefill"] == ops.attention_backends["decode"]
    assert ops.attention_backends["prefill"] in ("cudnn", "ours")
    assert "(" in ops.attention_backend  # the cuDNN version, or why cuDNN is missing
    if ops.attention_backends["prefill"] == "cudnn":  # short queries split the context
        assert ops.attention_backend.startswith("prefill=cudnn+split decode=cudnn (")


def test_gather_kv_copies_the_tabled_blocks_bit_exact(cp, bf16) -> None:
    from kernels.gather_kv import gather_kv, gather_kv_reference

    rng = np.random.default_rng(14)
    kv, tables = paged_case(rng, bf16, 16, [40, 200, 3], 8, 128, spare_width=2)
    k, v = gather_kv(cp.asarray(kv), 2, cp.asarray(tables))
    want_k, want_v = gather_kv_reference(kv, 2, tables)
    np.testing.assert_array_equal(cp.asnumpy(k).view(np.uint16), want_k.view(np.uint16))
    np.testing.assert_array_equal(cp.asnumpy(v).view(np.uint16), want_v.view(np.uint16))


def _bf16_nan(cp, shape):
    return cp.full(shape, 0x7FC0, dtype=cp.uint16)  # a quiet NaN's bits in bfloat16


def test_gather_kv_copies_only_the_rows_attention_reads(cp, bf16) -> None:
    """With context lengths, each sequence's blocks up to its length plus the margin are copied
    and the rest of a wide (graph-sized) table is not touched."""
    from kernels.gather_kv import copied_keys, gather_kv, gather_kv_reference

    rng = np.random.default_rng(15)
    lens = [40, 700, 3]
    kv, tables = paged_case(rng, bf16, 16, lens, 8, 128, spare_width=64)
    width_keys = tables.shape[1] * 16
    shape = (len(lens), width_keys, 8, 128)
    k_out, v_out = (_bf16_nan(cp, shape).view(cp.asarray(kv).dtype) for _ in range(2))
    k, v = gather_kv(cp.asarray(kv), 1, cp.asarray(tables), cp.asarray(lens, dtype=cp.int32),
                     k_out, v_out)
    want_k, want_v = gather_kv_reference(kv, 1, tables)
    for b, n in enumerate(lens):
        rows = copied_keys(n, 16, tables.shape[1])
        assert n + 256 <= rows < width_keys
        for got, want in ((k, want_k), (v, want_v)):
            got = cp.asnumpy(got[b]).view(np.uint16)
            np.testing.assert_array_equal(got[:rows], want[b, :rows].view(np.uint16))
            assert (got[rows:] == 0x7FC0).all()


@pytest.mark.parametrize("lens", [[700], [700, 300]])
def test_dense_prefill_over_a_wide_table_reads_no_row_past_the_copy(cp, bf16, cudnn_attn,
                                                                    monkeypatch, lens) -> None:
    """A graph's table is as wide as max_model_len: the dense path copies a short sequence's
    rows only, and cuDNN's padding mask keeps it from the rest. The gather's buffers are handed
    in filled with NaN, so one read of a row it did not copy would poison the output."""
    from kernels import cudnn_attention
    from kernels.gather_kv import copied_keys, gather_kv

    cudnn_attn.gather = True
    rng = np.random.default_rng(16)
    kv, tables = paged_case(rng, bf16, 16, lens, 8, 128, spare_width=200)
    width = 1 << (tables.shape[1] - 1).bit_length()  # the attention pads its table to this
    untouched = []

    def gather_into_nan(kv_cache, layer, table, context_lens=None, k_out=None, v_out=None):
        shape = (table.shape[0], table.shape[1] * 16, 8, 128)
        k_out, v_out = (_bf16_nan(cp, shape).view(kv_cache.dtype) for _ in range(2))
        for n in cp.asnumpy(context_lens).tolist():
            untouched.append(table.shape[1] * 16 - copied_keys(n, 16, table.shape[1]))
        return gather_kv(kv_cache, layer, table, context_lens, k_out, v_out)

    monkeypatch.setattr(cudnn_attention, "gather_kv", gather_into_nan)
    q_lens = lens  # cold prompts: every row a query row, all sequences dense
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), 32, 128)).astype(bf16)
    ctx = np.array(lens, dtype=np.int32)
    got = cudnn_attn.run_prefill(cp.asarray(q), cp.asarray(kv), 0, cp.asarray(tables),
                                 cp.asarray(cu), cp.asarray(ctx), 0.08, max(q_lens))
    assert got is not None, f"cuDNN refused the shape: {cudnn_attn.refusals}"
    assert len(untouched) == len(lens) and min(untouched) >= 1024  # NaN rows were there
    assert width * 16 - max(lens) - 256 >= 1024
    got = cp.asnumpy(got).astype(np.float32)
    assert np.isfinite(got).all()
    want = ref.paged_attention_prefill(q.astype(np.float32), kv.astype(np.float32), 0, tables,
                                       cu, ctx, 0.08)
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("lens,q_len", [([1000], 1000), ([2100], 700)])
def test_one_long_sequence_runs_at_its_exact_sizes(cp, bf16, cudnn_attn, lens, q_len) -> None:
    """With the host's bounds, one long sequence (cold, or a long turn over a cached prefix)
    runs the override-shape graph: no padding mask, same results."""
    cudnn_attn.gather = cudnn_attn.exact = True
    rng = np.random.default_rng(15)
    kv, tables = paged_case(rng, bf16, 16, lens, 8, 128, spare_width=5)
    cu, ctx = np.array([0, q_len], dtype=np.int32), np.array(lens, dtype=np.int32)
    q = rng.standard_normal((q_len, 32, 128)).astype(bf16)
    before = cudnn_attn.calls.get(("exact",), 0)
    got = cudnn_attn.run_prefill(cp.asarray(q), cp.asarray(kv), 1, cp.asarray(tables),
                                 cp.asarray(cu), cp.asarray(ctx), 0.088, q_len, lens[0])
    cudnn_attn.exact = False
    want = ref.paged_attention_prefill(q.astype(np.float32), kv.astype(np.float32), 1, tables,
                                       cu, ctx, 0.088)
    assert rel_err(cp.asnumpy(got), want) < 1e-2  # whichever path served it
    exact_refusals = [why for key, why in cudnn_attn.refusals.items() if key[0] == "exact"]
    if exact_refusals:  # cuDNN 9.19 on an H100: no engine takes override shapes for this graph
        pytest.skip(f"this cuDNN refuses override shapes: {exact_refusals[0]}")
    assert cudnn_attn.calls.get(("exact",), 0) == before + 1


def _sealed_attention_with_builder(cp, tmp_path):
    """A cuDNN attention after the seal, with its builder process and build log (skips where
    cuDNN is missing); the caller closes the builder."""
    from kernels.build_log import BuildLog
    from kernels.cudnn_attention import CudnnAttention, CudnnUnavailable
    from kernels.plan_builder import PlanBuilder
    from kernels.plan_cache import PlanCache

    builds = BuildLog()
    builder = PlanBuilder(cp.cuda.Device().id)
    try:
        attn = CudnnAttention(builds, PlanCache(tmp_path / "plans"), builder)
    except CudnnUnavailable as exc:
        builder.close()
        pytest.skip(f"cuDNN is not available here: {exc}")
    builds.seal()
    return builds, builder, attn


def _prefill_case(cp, bf16, seed: int, lens: list[int], q_lens: list[int]):
    """``run_prefill``'s arguments but the last (Qwen3-4B heads, shuffled blocks) and the
    reference output."""
    rng = np.random.default_rng(seed)
    kv, tables = paged_case(rng, bf16, 16, lens, 8, 128)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), 32, 128)).astype(bf16)
    ctx = np.array(lens, dtype=np.int32)
    args = (cp.asarray(q), cp.asarray(kv), 1, cp.asarray(tables), cp.asarray(cu),
            cp.asarray(ctx), 128 ** -0.5)
    want = ref.paged_attention_prefill(q.astype(np.float32), kv.astype(np.float32), 1, tables,
                                       cu, ctx, 128 ** -0.5)
    return args, want


def test_after_the_seal_a_new_shape_is_built_beside_and_our_kernel_serves_meanwhile(
        cp, bf16, tmp_path) -> None:
    """No request waits for a build after ready: the first call of a new shape answers None
    (the caller's kernel serves), the builder process builds the graph, and a later call
    loads it and runs cuDNN, matching the reference."""
    from kernels.build_log import CUDNN_BACKGROUND, CUDNN_GRAPH

    builds, builder, attn = _sealed_attention_with_builder(cp, tmp_path)
    try:
        q_lens = [300, 200, 250]
        args, want = _prefill_case(cp, bf16, 5, [1500, 700, 900], q_lens)
        assert attn.run_prefill(*args, max(q_lens)) is None  # not built: the caller's kernel
        assert builds.snapshot()["after"] == {}  # and nobody waited for a build (the wall
        # clock is no witness here: alone in a process, this first call took 0.96 s on an H200)
        deadline, got = time.monotonic() + 120, None
        while got is None and time.monotonic() < deadline:
            time.sleep(0.05)
            got = attn.run_prefill(*args, max(q_lens))
        assert got is not None, f"never built: {builder.counts} {attn.refusals}"
        assert rel_err(cp.asnumpy(got), want) < 1e-2
        after = builds.snapshot()["after"]
        assert after.get(CUDNN_GRAPH, 0) == 0 and after.get(CUDNN_BACKGROUND, 0) >= 1
        assert builder.counts["built"] >= 1 and builder.counts["crashes"] == 0
        assert any((tmp_path / "plans").iterdir())  # kept on disk for the next start
    finally:
        builder.close()


def test_a_graph_built_beside_is_loaded_while_the_device_is_busy_not_in_a_request(
        cp, bf16, tmp_path) -> None:
    """The engine loads what the builder sent back during a device step it waits for anyway
    (``load_built``): the next call of the shape finds the graph in memory, and the load is
    counted as hidden, not as a first-use build. With the device idle nothing is loaded."""
    from kernels.build_log import CUDNN_BACKGROUND

    builds, builder, attn = _sealed_attention_with_builder(cp, tmp_path)
    try:
        q_lens = [260, 180]
        args, want = _prefill_case(cp, bf16, 6, [1300, 600], q_lens)
        assert attn.run_prefill(*args, max(q_lens)) is None  # handed to the builder
        deadline = time.monotonic() + 120
        while not builder.finished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert builder.finished(), f"never built: {builder.counts} {attn.refusals}"
        assert attn.plans.load_built(lambda: False) == 0  # the device is idle: not now
        assert attn.plans.load_built(lambda: True) == 1
        assert builder.finished() == []
        got = attn.run_prefill(*args, max(q_lens))
        assert got is not None
        assert rel_err(cp.asnumpy(got), want) < 1e-2
        snap = builds.snapshot()
        assert snap["after"].get(CUDNN_BACKGROUND, 0) == 0  # no request loaded it
        assert snap["hidden"].get(CUDNN_BACKGROUND, 0) == 1
    finally:
        builder.close()
