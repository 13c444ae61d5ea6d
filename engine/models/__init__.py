"""Model code: the Llama-family decoder over ``Ops`` and its rotary tables."""

from __future__ import annotations

from engine.models.decoder import DecoderModel, ForwardBatch

__all__ = ["DecoderModel", "ForwardBatch"]
