"""PromptTokenizer: text -> token ids with a cache of segments between special tokens.

A tokenizer splits its input at added (special) tokens first and encodes the pieces between them
independently, so `encode(text)` is the concatenation of the encodings of those pieces. A chat
prompt is a run of `<|im_start|>role\\n...<|im_end|>` segments; in a multi-turn conversation every
earlier message is a segment seen before, and only the new turn needs the tokenizer (which costs
tens of ms at 16k tokens, more than the whole HBM-hit TTFT budget).
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvengine.server")

_MIN_CACHED_CHARS = 64  # shorter segments are cheaper to encode than to look up and copy
_SELF_CHECK_TEXTS = (
    "plain text without special tokens, numbers 12345 and  two  spaces\n",
    "{0}system\nYou are terse.{1}\n{0}user\nHello there!  How are you?{1}\n{0}assistant\n",
    "{1}{0}{0} leading and trailing spaces {1} x{1}\n\n{0}",
)


class PromptTokenizer:
    """Wraps the engine's tokenizer (`encode(text, add_special_tokens)`); results equal it exactly.

    Segmenting is on only when every added token of tokenizer.json is matched verbatim
    (no lstrip/rstrip/single_word/normalized flags) and a self-check against whole-text encoding
    passes; otherwise only whole texts are cached. At most `max_cached_tokens` are kept (LRU).
    """

    def __init__(self, tokenizer: Any, model_dir: str | Path | None,
                 max_cached_tokens: int = 1 << 20) -> None:
        self._tokenizer = tokenizer
        self._max_cached_tokens = max_cached_tokens
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._num_cached_tokens = 0
        self.num_hits = 0
        self.num_misses = 0
        self._special_ids: dict[str, int] = {}
        self._pattern: re.Pattern[str] | None = None
        specials = _verbatim_added_tokens(model_dir)
        if specials:
            self._special_ids = specials
            # Longest first: at one position the longest added token wins, as in `tokenizers`.
            alternatives = sorted(specials, key=len, reverse=True)
            self._pattern = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        # Special ids the post-processor adds around a text (e.g. BOS), learned from one probe.
        probe = "probe text"
        plain = list(tokenizer.encode(probe, add_special_tokens=False))
        full = list(tokenizer.encode(probe, add_special_tokens=True))
        at = _find(full, plain)
        self._affixes = (full[:at], full[at + len(plain):]) if at >= 0 else None
        if self._pattern is not None and not self._self_check():
            logger.warning("segmented tokenization disagrees with the tokenizer; caching whole "
                           "prompts only")
            self._pattern = None

    @property
    def segmented(self) -> bool:
        """True when prompts are split at special tokens for caching."""
        return self._pattern is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Exactly `tokenizer.encode(text, add_special_tokens)`, from cache where possible."""
        if add_special_tokens and self._affixes is None:
            return list(self._tokenizer.encode(text, add_special_tokens=True))
        ids: list[int] = []
        if self._pattern is None:
            ids.extend(self._segment(text))
        else:
            for i, piece in enumerate(self._pattern.split(text)):
                if i % 2:  # odd pieces are the separators: special tokens
                    ids.append(self._special_ids[piece])
                elif piece:
                    ids.extend(self._segment(piece))
        if add_special_tokens:
            assert self._affixes is not None
            prefix, suffix = self._affixes
            return [*prefix, *ids, *suffix]
        return ids

    def _segment(self, piece: str) -> list[int] | array:
        if len(piece) < _MIN_CACHED_CHARS:
            return self._tokenizer.encode(piece, add_special_tokens=False)
        hit = self._cache.get(piece)
        if hit is not None:
            self._cache.move_to_end(piece)
            self.num_hits += 1
            return hit
        self.num_misses += 1
        ids = array("i", self._tokenizer.encode(piece, add_special_tokens=False))
        if len(ids) <= self._max_cached_tokens:
            self._cache[piece] = ids
            self._num_cached_tokens += len(ids)
            while self._num_cached_tokens > self._max_cached_tokens:
                _, old = self._cache.popitem(last=False)
                self._num_cached_tokens -= len(old)
        return ids

    def _self_check(self) -> bool:
        open_tok, close_tok = (sorted(self._special_ids) * 2)[:2]
        for template in _SELF_CHECK_TEXTS:
            text = template.format(open_tok, close_tok) * 3
            for add in (False, True):
                if add and self._affixes is None:
                    continue
                expected = list(self._tokenizer.encode(text, add_special_tokens=add))
                if self.encode(text, add_special_tokens=add) != expected:
                    return False
        self._cache.clear()
        self._num_cached_tokens = 0
        self.num_hits = self.num_misses = 0
        return True


def _find(haystack: list[int], needle: list[int]) -> int:
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start:start + len(needle)] == needle:
            return start
    return -1


def _verbatim_added_tokens(model_dir: str | Path | None) -> dict[str, int]:
    """content -> id of tokenizer.json's added tokens, or {} if any is not matched verbatim."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / "tokenizer.json"
    try:
        added = json.loads(path.read_text()).get("added_tokens") or []
    except (OSError, ValueError):
        return {}
    specials: dict[str, int] = {}
    for token in added:
        if any(token.get(flag) for flag in ("lstrip", "rstrip", "single_word", "normalized")):
            return {}
        content = token.get("content")
        if not isinstance(content, str) or not content or not isinstance(token.get("id"), int):
            return {}
        specials[content] = token["id"]
    return specials
