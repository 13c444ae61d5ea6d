"""A thinking variant of the tiny checkpoint, for the tests of constraints after reasoning.

The make-model tokenizer has no ``<think>`` / ``</think>`` tokens (its chat template writes no
thinking), so a grammar cannot wait for them. This copy adds both as tokens of their own, as
Qwen3's tokenizer has them (added, not special: they stay in the decoded text), at ids the
model's embedding already has (make-model pads the vocabulary to a multiple of 64; the output
rows of those ids are zeros), and gives its chat template Qwen3's ``enable_thinking`` switch:
false writes the empty block ``<think>\\n\\n</think>\\n\\n`` after the generation prompt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from engine.make_model import CHAT_TEMPLATE

START, END = "<think>", "</think>"
_GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(_GENERATION_PROMPT, (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"))


def write_thinking_model(tiny_model_dir: Path, out: Path) -> tuple[int, int]:
    """Copy ``tiny_model_dir`` to ``out`` with the thinking tokens and template; returns the
    ids of ``<think>`` and ``</think>``."""
    assert THINKING_TEMPLATE != CHAT_TEMPLATE
    shutil.copytree(tiny_model_dir, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(marker, special=False, normalized=False)
                    for marker in (START, END)])
    ids = tok.token_to_id(START), tok.token_to_id(END)
    vocab_size = json.loads((out / "config.json").read_text())["vocab_size"]
    assert max(ids) < vocab_size, "no padding rows left in the tiny model's vocabulary"
    tok.save(str(out / "tokenizer.json"))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return ids
