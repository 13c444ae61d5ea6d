"""Text <-> token ids and chat prompts, from tokenizer.json + tokenizer_config.json."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.chat_template import ChatTemplate

# The special tokens transformers hands a chat template (its `special_tokens_map`).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


class Tokenizer:
    """A ``tokenizers`` tokenizer plus eos/bos and the chat template of the model folder."""

    def __init__(self, model_dir: str | Path, extra_eos_token_ids: Iterable[int] = ()) -> None:
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model folder {str(model_dir)!r}")
        self._tok = HFTokenizer.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids = list(extra_eos_token_ids)
        generation = _read_json(folder / "generation_config.json").get("eos_token_id")
        eos_ids += [generation] if isinstance(generation, int) else list(generation or [])
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos_ids.append(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.chat_template = _find_chat_template(folder, config)
        self._special_tokens = _special_tokens_map(config)
        self._template: ChatTemplate | None = None

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows (the model's embedding may have more rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance reads for structured outputs)."""
        return self._tok.to_str()

    def token_strings(self, token_ids: Iterable[int]) -> list[str]:
        """Each id's vocabulary entry ("" for an id the vocabulary lacks)."""
        return [self._tok.id_to_token(int(i)) or "" for i in token_ids]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the folder's chat template over ``messages`` as transformers does
        (engine/chat_template.py); ``kwargs`` (``tools``, ``enable_thinking``, ...) reach it."""
        if self.chat_template is None:
            raise ValueError("this model folder has no chat template")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template, self._special_tokens)
        return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     **kwargs)


def _special_tokens_map(config: dict[str, Any]) -> dict[str, Any]:
    tokens: dict[str, Any] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name))
        if text is not None:
            tokens[name] = text
    extra = [_token_text(t) for t in config.get("additional_special_tokens") or ()]
    if any(extra):
        tokens["additional_special_tokens"] = [t for t in extra if t]
    return tokens


def _find_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    path = folder / "chat_template.jinja"
    return path.read_text() if path.is_file() else None
