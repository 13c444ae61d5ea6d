"""server: the OpenAI-compatible HTTP API of kvengine (FastAPI app, async engine, CLI)."""
