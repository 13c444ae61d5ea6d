"""SIZE parsing (`--dram 4GiB`) and the human byte format."""

from __future__ import annotations

import pytest

from kvstore.sizes import format_bytes, parse_size

KIB, MIB, GIB, TIB = 1024, 1024**2, 1024**3, 1024**4


@pytest.mark.parametrize(("text", "expected"), [
    ("0", 0),
    ("1024", 1024),
    ("  77  ", 77),
    ("1B", 1),
    ("512MiB", 512 * MIB),
    ("512mib", 512 * MIB),
    ("512 MiB", 512 * MIB),
    ("4GiB", 4 * GIB),
    ("4gib", 4 * GIB),
    ("4GIB", 4 * GIB),
    ("1TiB", TIB),
    ("1KiB", KIB),
    ("1.5GB", 1_500_000_000),
    ("1.5GiB", 3 * GIB // 2),
    ("1.5gb", 1_500_000_000),
    ("2KB", 2000),
    ("3MB", 3_000_000),
    ("1TB", 10**12),
    (".5KiB", 512),
    ("0.1KB", 100),
    ("1.0000001KB", 1000),  # rounded down to whole bytes
    ("2.", 2),
    # Kubernetes' spellings: Ki/Mi/Gi/Ti are powers of two, K/M/G/T powers of ten.
    ("16Gi", 16 * GIB),
    ("16gi", 16 * GIB),
    ("512Mi", 512 * MIB),
    ("1Ti", TIB),
    ("4Ki", 4 * KIB),
    ("1.5Gi", 3 * GIB // 2),
    ("16G", 16 * 10**9),
    ("16g", 16 * 10**9),
    ("512M", 512 * 10**6),
    ("4K", 4000),
    ("2T", 2 * 10**12),
])
def test_parse_size_table(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "needle"), [
    ("", "invalid size"),
    ("abc", "invalid size"),
    ("-1", "invalid size"),
    ("1.5", "whole number"),
    ("12XB", "unknown unit 'XB'"),
    ("4 G i B", "invalid size"),
    ("1e9", "invalid size"),
    ("GiB", "invalid size"),
    ("1..5GB", "invalid size"),
    ("0x10", "invalid size"),
])
def test_parse_size_rejects_with_clear_message(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")) as info:
        parse_size(text)
    assert repr(text) in str(info.value) or text == ""


def test_parse_size_ints_and_non_strings() -> None:
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError):
        parse_size(-5)
    with pytest.raises(ValueError):
        parse_size(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        parse_size(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(("num_bytes", "text"), [
    (0, "0 B"),
    (1023, "1023 B"),
    (1024, "1.00 KiB"),
    (1536, "1.50 KiB"),
    (512 * MIB, "512 MiB"),
    (64 * MIB, "64.0 MiB"),
    (4 * GIB, "4.00 GiB"),
    (3 * TIB, "3.00 TiB"),
    (-2048, "-2.00 KiB"),
])
def test_format_bytes(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize("num_bytes", [1, 1000, 4096, 123_456_789, 5 * GIB])
def test_format_then_parse_is_close(num_bytes: int) -> None:
    value, unit = format_bytes(num_bytes).split()
    assert abs(parse_size(f"{value}{unit}") - num_bytes) <= 0.01 * num_bytes
