"""The block store: the DRAM tier, the SSD tier below it, and the demoter between them."""
