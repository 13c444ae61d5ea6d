"""The SSD tier: preallocated data files, an LMDB index, offset allocators."""
