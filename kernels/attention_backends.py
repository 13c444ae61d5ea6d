"""Which attention implementation serves each phase, from ``KVSTORE_ATTENTION``.

``auto`` (the default) and ``cudnn``: cuDNN's fused SDPA for prefill and decode (the faster on
an H100 in both: kernels/KERNELS.md); ``ours``: our kernels only. A backend that cannot load
cuDNN serves every phase with our kernels and says so (``Ops.attention_backend``).
"""

from __future__ import annotations

import os

_CHOICES = {
    "auto": {"prefill": "cudnn", "decode": "cudnn"},
    "cudnn": {"prefill": "cudnn", "decode": "cudnn"},
    "ours": {"prefill": "ours", "decode": "ours"},
}


def wanted_backends(choice: str | None = None) -> dict[str, str]:
    """{"prefill": name, "decode": name} for ``choice`` (default: ``$KVSTORE_ATTENTION``)."""
    if choice is None:
        choice = os.environ.get("KVSTORE_ATTENTION", "auto")
    key = choice.strip().lower()
    if key not in _CHOICES:
        raise ValueError(f"KVSTORE_ATTENTION={choice!r}; expected one of {sorted(_CHOICES)}")
    return dict(_CHOICES[key])
