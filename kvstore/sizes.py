"""Byte sizes as users write them (``512MiB``, ``4GiB``, ``16Gi``, ``1.5GB``, ``16G``, ``1024``)
and as printed.

Units follow Kubernetes' quantities: ``Ki``, ``Mi``, ``Gi``, ``Ti`` (and ``KiB``... ) are powers
of two (1024, 1024², ...); ``K``, ``M``, ``G``, ``T`` (and ``KB``...) are powers of ten (1000,
1000², ...), so ``16G`` is 16,000,000,000 bytes and ``16Gi`` is 17,179,869,184. Case does not
matter (``16gi``, ``16g``).
"""

from __future__ import annotations

import math
import re

# Decimal units are powers of 1000, binary units powers of 1024; matched case-insensitively.
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgt", start=1):
    _UNITS[_prefix] = _UNITS[_prefix + "b"] = 1000**_power
    _UNITS[_prefix + "i"] = _UNITS[_prefix + "ib"] = 1024**_power

_SIZE_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a SIZE (``512MiB``, ``4GiB``, ``16Gi``, ``1.5GB``, ``16G``, ``1024``) into bytes;
    ValueError if malformed.

    A fractional result is rounded down to whole bytes; a fraction of a byte (``1.5``) is an error.
    """
    if isinstance(text, bool):
        raise ValueError("a size must be a number of bytes or a string like 4GiB, not a boolean")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"a size must be a string like 4GiB, got {type(text).__name__}")
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"invalid size {text!r}: expected a number with an optional unit, "
                         "e.g. 1024, 512MiB, 16Gi, 1.5GB, 16G")
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: unknown unit {match['unit']!r} "
                         "(powers of two: Ki, Mi, Gi, Ti or KiB...; powers of ten: K, M, "
                         "G, T or KB...; or B)")
    number = match["num"]
    multiplier = _UNITS[unit]
    if "." not in number:
        return int(number) * multiplier
    # Exact decimal arithmetic: "1.5GB" is 1_500_000_000, not a float's approximation of it.
    whole, _, frac = number.partition(".")
    scale = 10 ** len(frac)
    numerator = (int(whole or "0") * scale + int(frac or "0")) * multiplier
    if multiplier == 1 and numerator % scale:
        raise ValueError(f"invalid size {text!r}: a byte count must be a whole number")
    return numerator // scale


def format_bytes(num_bytes: int | float) -> str:
    """A short human form with binary units: ``0 B``, ``512 B``, ``1.5 KiB``, ``4.00 GiB``."""
    if not math.isfinite(num_bytes):
        return str(num_bytes)
    sign = "-" if num_bytes < 0 else ""
    value = abs(float(num_bytes))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    digits = 2 if value < 10 else 1 if value < 100 else 0
    return f"{sign}{value:.{digits}f} {unit}"
