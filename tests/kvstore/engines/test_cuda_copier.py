"""GPU: batched block copies HBM <-> pinned host are byte-exact, by memcpy runs and by kernel."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.engines.run_arrays import CopyRun, coalesce

pytestmark = pytest.mark.gpu

BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2  # Qwen3-4B layout, bf16


def test_coalesce_merges_only_runs_contiguous_on_both_sides() -> None:
    runs = [CopyRun(0, 100, 10), CopyRun(10, 110, 10), CopyRun(20, 200, 10), CopyRun(30, 210, 0)]
    assert coalesce(runs) == [CopyRun(0, 100, 20), CopyRun(20, 200, 10)]


@pytest.mark.parametrize("method", ["memcpy", "kernel"])
def test_save_scramble_load_round_trip_is_byte_exact(method: str) -> None:
    import cupy as cp

    from kernels.block_copy import copy_runs
    from kvstore.engines.copier import CudaCopier

    num_blocks = 64
    arena = cp.random.randint(0, 256, size=num_blocks * BLOCK_BYTES, dtype=cp.uint8)
    expect = arena.copy()
    pinned = cp.cuda.alloc_pinned_memory(num_blocks * BLOCK_BYTES)
    host = np.frombuffer(pinned, dtype=np.uint8, count=num_blocks * BLOCK_BYTES)
    host[:] = 0
    rng = np.random.default_rng(1)
    slots = rng.permutation(num_blocks)
    dev = [arena.data.ptr + b * BLOCK_BYTES for b in range(num_blocks)]
    hst = [host.ctypes.data + int(s) * BLOCK_BYTES for s in slots]
    if method == "memcpy":
        copier = CudaCopier(0)
        copier.device_to_host([CopyRun(d, h, BLOCK_BYTES) for d, h in zip(dev, hst)]).wait()
    else:
        copy_runs(dev, hst, BLOCK_BYTES)
        cp.cuda.get_current_stream().synchronize()
    host_blocks = host.reshape(num_blocks, BLOCK_BYTES)
    for b, s in enumerate(slots):
        want = cp.asnumpy(expect[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES])
        assert np.array_equal(host_blocks[s], want)
    arena.fill(7)
    if method == "memcpy":
        copier.host_to_device([CopyRun(h, d, BLOCK_BYTES) for d, h in zip(dev, hst)]).wait()
    else:
        copy_runs(hst, dev, BLOCK_BYTES)
        cp.cuda.get_current_stream().synchronize()
    assert bool(cp.array_equal(arena, expect))


def test_kernel_rejects_misaligned_runs() -> None:
    from kernels.block_copy import copy_runs

    with pytest.raises(ValueError):
        copy_runs([8], [16], 32)
    with pytest.raises(ValueError):
        copy_runs([16], [16], 24)


@pytest.mark.parametrize("num_runs", [3, 40])  # below and above the gather-kernel threshold
def test_device_to_device_runs_of_uneven_lengths_are_byte_exact(num_runs: int) -> None:
    """Shuffled uneven runs between two device buffers: memcpy calls for few runs, one
    ``copy_runs_varlen`` launch for many; every byte lands where it should, nothing else moves."""
    import cupy as cp

    from kvstore.engines.copier import CudaCopier

    rng = np.random.default_rng(2)
    sizes = (rng.integers(1, 4096, num_runs) * 16).tolist()
    total = sum(sizes)
    src = cp.random.randint(0, 256, size=total, dtype=cp.uint8)
    dst = cp.zeros(2 * total, dtype=cp.uint8)
    src_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
    order = rng.permutation(num_runs)
    dst_offsets, at = [0] * num_runs, 0
    for r in order:  # the destination gets the runs in another order, with 16-byte gaps
        dst_offsets[r] = at
        at += sizes[r] + 16
    runs = [CopyRun(src.data.ptr + s, dst.data.ptr + d, n)
            for s, d, n in zip(src_offsets, dst_offsets, sizes)]
    CudaCopier(0).device_to_device(runs).wait()
    host_src, host_dst = cp.asnumpy(src), cp.asnumpy(dst)
    expect = np.zeros_like(host_dst)
    for s, d, n in zip(src_offsets, dst_offsets, sizes):
        expect[d:d + n] = host_src[s:s + n]
    assert np.array_equal(host_dst, expect)


def test_varlen_kernel_rejects_bad_runs() -> None:
    from kernels.block_copy import copy_runs_varlen

    with pytest.raises(ValueError):
        copy_runs_varlen([16], [16], [24])
    with pytest.raises(ValueError):
        copy_runs_varlen([16, 32], [16], [16])
