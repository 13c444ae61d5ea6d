"""Test parts shared across test folders (a fake engine's KV arena...)."""
