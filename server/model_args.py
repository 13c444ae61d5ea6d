"""The model options `kvengine serve` and `kvengine router` share: MODEL, --model, --revision,
--tokenizer and --chat-template.

One definition for both programs; the router takes them to render prompts exactly as the
engines do, so only their help differs (``ModelHelp``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

_JINJA_CHARS = "{}\n"


@dataclass(frozen=True)
class ModelHelp:
    """The help texts that differ between the programs."""

    model: str
    revision: str
    tokenizer: str
    chat_template: str


ENGINE_MODEL = ModelHelp(
    model="model folder (config.json, *.safetensors, tokenizer.json) or Hugging Face repo id "
    "(Qwen/Qwen3-0.6B: the cached snapshot, downloaded unless HF_HUB_OFFLINE=1), as in `vllm "
    "serve MODEL`; or give --model",
    revision="hub revision (branch, tag or commit) of a repo id (default: main)",
    tokenizer="tokenizer folder or repo id (default: the model's)",
    chat_template="chat template file, or the template text itself, replacing the tokenizer's "
    "(default: the tokenizer folder's)")

ROUTER_MODEL = ModelHelp(
    model="the engines' model folder or Hugging Face repo id: its tokenizer and chat template "
    "render prompts exactly as the engines do (the hub cache, as `kvengine serve MODEL` finds "
    "it); or give --model",
    revision="hub revision of a repo id, as given to the engines",
    tokenizer="tokenizer folder or repo id, as given to the engines (default: the model's)",
    chat_template="the chat template file or text the engines were given, if any")


def chat_template_text(value: str) -> str:
    """`--chat-template`: a file's text, or the template itself when it holds Jinja characters
    (as vLLM decides); ArgumentTypeError for a path that does not exist."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {value}: {exc}") from None
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{value} is empty")
        return text
    if not any(char in value for char in _JINJA_CHARS):
        raise argparse.ArgumentTypeError(f"{value!r} looks like a file path, but there is no "
                                         "such file (an inline template holds {{ or {%)")
    return value


def add_model_args(parser: argparse.ArgumentParser, who: ModelHelp) -> None:
    """Add the shared model options to ``parser``."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=who.model)
    parser.add_argument("--model", default=None,
                        help="the same as MODEL (default: MODEL; one of the two is required)")
    parser.add_argument("--revision", default=None, help=who.revision)
    parser.add_argument("--tokenizer", default=None, help=who.tokenizer)
    parser.add_argument("--chat-template", type=chat_template_text, default=None,
                        help=who.chat_template)
