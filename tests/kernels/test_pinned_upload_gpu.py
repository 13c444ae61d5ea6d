"""GPU: PinnedUpload delivers every byte: tensors smaller than a staging buffer (many share one),
one larger than both buffers together, odd sizes, and device work enqueued after an upload on
the same stream (a fused weight's concatenate) sees the bytes before ``finish``."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_every_byte_arrives_and_later_device_work_sees_it() -> None:
    import cupy as cp

    from kernels.pinned_upload import PinnedUpload

    rng = np.random.default_rng(0)
    upload = PinnedUpload(buffer_bytes=1 << 20, threads=4)  # small buffers: many switches
    hosts = [rng.integers(0, 2**16, size, dtype=np.uint16) for size in
             (1, 7, 4096, 300_000, 1 << 19, (5 << 20) // 2 + 3, 123_457)]
    hosts.append(rng.standard_normal((64, 1000), dtype=np.float32))  # 2-D, 256,000 bytes
    outs = [upload.upload(h) for h in hosts]
    joined = cp.concatenate([outs[2], outs[3]])  # before finish: ordered on the stream
    upload.finish()
    for host, out in zip(hosts, outs, strict=True):
        assert out.dtype == host.dtype and out.shape == host.shape
        np.testing.assert_array_equal(cp.asnumpy(out), host)
    np.testing.assert_array_equal(cp.asnumpy(joined), np.concatenate([hosts[2], hosts[3]]))
