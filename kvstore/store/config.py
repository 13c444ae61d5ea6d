"""The tiered store's configuration: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvstore.store.eviction import POLICIES
from kvstore.store.ssd.files import IO_MODES
from kvstore.store.ssd.tier import DEFAULT_MAX_FILE_BYTES


@dataclass(frozen=True)
class StoreConfig:
    """What a TieredStore is built from; validated once at construction."""

    dram_bytes: int
    ssd_dir: Path | None = None
    ssd_bytes: int = 0
    pin_memory: bool | None = None  # None: pin when CuPy sees a GPU
    eviction: str = "lru"
    demote_high_watermark: float = 0.9
    demote_low_watermark: float = 0.75
    lease_ttl_s: float = 30.0  # the longest lease the store grants
    debug_hash_bits: int | None = None  # key blocks by truncated hashes (collision tests only)
    ssd_io_mode: str = "auto"  # "auto", "direct" or "buffered"
    ssd_max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    alignment: int = 4096

    def __post_init__(self) -> None:
        if self.ssd_dir is not None and not isinstance(self.ssd_dir, Path):
            object.__setattr__(self, "ssd_dir", Path(self.ssd_dir))
        if self.dram_bytes < self.alignment:
            raise ValueError(f"dram_bytes must be at least {self.alignment}")
        if self.ssd_bytes < 0:
            raise ValueError("ssd_bytes must be >= 0")
        if self.eviction not in POLICIES:
            raise ValueError(f"eviction must be one of {sorted(POLICIES)}, got {self.eviction!r}")
        if not 0.0 < self.demote_low_watermark < self.demote_high_watermark <= 1.0:
            raise ValueError("need 0 < demote_low_watermark < demote_high_watermark <= 1")
        if self.lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        if self.debug_hash_bits is not None and not 1 <= self.debug_hash_bits <= 128:
            raise ValueError("debug_hash_bits must be in 1..128")
        if self.ssd_io_mode not in IO_MODES:
            raise ValueError(f"ssd_io_mode must be one of {IO_MODES}")
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError("alignment must be a power of two")

    @property
    def ssd_enabled(self) -> bool:
        return self.ssd_dir is not None and self.ssd_bytes > 0
