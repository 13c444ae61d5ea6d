"""The DRAM tier: pinned host pool, block index, eviction policy and pins."""
