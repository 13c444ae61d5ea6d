"""SamplingDefaults: the model's generation_config sampling values, filled into request bodies.

A request field the client sent always wins; only fields left out (None) take the model's value,
which is what vLLM does with `--generation-config auto`. A default whose request field this server
does not have is reported once at start, never silently dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

logger = logging.getLogger("kvengine.server")

Body = TypeVar("Body", bound=BaseModel)


class SamplingDefaults:
    """Defaults for the request models in `request_types`; `values` maps field -> value."""

    def __init__(self, values: Mapping[str, Any], request_types: tuple[type[BaseModel], ...],
                 source: str = "generation_config.json") -> None:
        self.values = dict(values)
        self.source = source
        self.unapplied = sorted(name for name in self.values if not any(
            name in t.model_fields for t in request_types))
        if self.values:
            applied = {k: v for k, v in self.values.items() if k not in self.unapplied}
            logger.info("default sampling parameters from %s: %s", source, applied)
        if self.unapplied:
            logger.warning("%s sets %s, which this server's requests cannot carry: not applied",
                           source, ", ".join(self.unapplied))

    def apply(self, body: Body) -> Body:
        """`body` with every field it left out (None) set to the model's default."""
        fields = type(body).model_fields
        update = {name: value for name, value in self.values.items()
                  if name in fields and getattr(body, name) is None}
        if "max_tokens" in update and getattr(body, "max_completion_tokens", None) is not None:
            del update["max_tokens"]  # the chat field that supersedes max_tokens was sent
        return body.model_copy(update=update) if update else body
