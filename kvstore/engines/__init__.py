"""What the daemon knows of registered engines: their memory, the HBM tier, the copies."""
