"""Text <-> token ids and chat prompts, from tokenizer.json + tokenizer_config.json."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


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


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


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
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows (the model's embedding may have more rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: Iterable[int]) -> list[str]:
        """Each id's vocabulary entry ("" for an id the vocabulary lacks)."""
        return [self._tok.id_to_token(int(i)) or "" for i in token_ids]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the folder's chat template (sandboxed jinja2) over ``messages``."""
        if self.chat_template is None:
            raise ValueError("this model folder has no chat template")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )


def _find_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    path = folder / "chat_template.jinja"
    return path.read_text() if path.is_file() else None
