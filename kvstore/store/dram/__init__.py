"""The DRAM tier: pinned host pool, block index, eviction policy, pins and the write path."""
