"""The HBM tier: blocks resident in other engines' arenas, served by arena-to-arena copies."""
