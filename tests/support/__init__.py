"""Test parts shared across test folders (a fake engine's KV arena, a real `kvengine serve`
process...)."""
