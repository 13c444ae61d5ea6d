"""GPU: PinnedUpload delivers every byte in the background: tensors smaller than a staging buffer
(many share one), one larger than both buffers together, odd sizes, stacked parts in their rows;
device work on the caller's stream runs while it copies; ``close`` gives up without a copy
outliving it, and a finish after it says the weights never arrived."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _hosts() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    hosts = [rng.integers(0, 2**16, size, dtype=np.uint16) for size in
             (1, 7, 4096, 300_000, 1 << 19, (5 << 20) // 2 + 3, 123_457)]
    hosts.append(rng.standard_normal((64, 1000), dtype=np.float32))  # 2-D, 256,000 bytes
    return hosts


def test_every_byte_arrives_while_the_callers_stream_works() -> None:
    import cupy as cp

    from kernels.pinned_upload import PinnedUpload

    upload = PinnedUpload(buffer_bytes=1 << 20, threads=4)  # small buffers: many switches
    hosts = _hosts()
    outs = [upload.upload(h) for h in hosts]
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((rows, 96), dtype=np.float32) for rows in (40, 8, 8, 1)]
    stacked = upload.upload_stacked(parts)
    assert upload.num_bytes == sum(h.nbytes for h in hosts) + sum(p.nbytes for p in parts)
    upload.start()
    x = cp.ones((512, 512), dtype=cp.float32)
    for _ in range(20):  # the caller's own work while the bytes move
        x = (x @ x) / 512
    upload.finish()
    assert float(x[0, 0]) == pytest.approx(1.0)
    for host, out in zip(hosts, outs, strict=True):
        assert out.dtype == host.dtype and out.shape == host.shape
        np.testing.assert_array_equal(cp.asnumpy(out), host)
    np.testing.assert_array_equal(cp.asnumpy(stacked), np.concatenate(parts))
    assert upload.seconds is not None and upload.seconds > 0


def test_stacking_parts_of_different_widths_is_refused() -> None:
    from kernels.pinned_upload import PinnedUpload

    upload = PinnedUpload(buffer_bytes=1 << 20, threads=2)
    with pytest.raises(ValueError, match="cannot stack"):
        upload.upload_stacked([np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)])
    upload.start()
    with pytest.raises(RuntimeError, match="has started"):
        upload.upload(np.zeros(4, np.float32))
    upload.finish()


def test_close_gives_up_and_a_later_finish_says_so() -> None:
    from kernels.pinned_upload import PinnedUpload, UploadFailed

    upload = PinnedUpload(buffer_bytes=1 << 20, threads=2)
    for _ in range(64):
        upload.upload(np.zeros(1 << 20, np.uint8))  # 64 buffers' worth
    upload.start()
    upload.close()  # returns once no copy is in flight
    with pytest.raises(UploadFailed):
        upload.finish()
