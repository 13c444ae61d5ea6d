"""PromptTokenizer: text -> token ids with a per-tenant cache of segments between special tokens.

A tokenizer splits its input at added (special) tokens first and encodes the pieces between them
independently, so `encode(text)` is the concatenation of the encodings of those pieces. A chat
prompt is a run of `<|im_start|>role\\n...<|im_end|>` segments; in a multi-turn conversation every
earlier message is a segment seen before, and only the new turn needs the tokenizer (which costs
tens of ms at 16k tokens, more than the whole HBM-hit TTFT budget).

The cache is keyed by tenant and content: a hit is faster than a miss, so a cache shared by all
tenants would tell one tenant (by timing) whether another had sent a text.
"""

from __future__ import annotations

import logging
import re
import threading
from array import array
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Protocol

from server.engine_protocol import PromptCodec
from server.tokenizer_file import TokenizerFile

logger = logging.getLogger("kvengine.server")

_MIN_CACHED_CHARS = 64  # shorter segments are cheaper to encode than to look up and copy
_SELF_CHECK_TEXTS = (
    "plain text without special tokens, numbers 12345 and  two  spaces\n",
    "{0}system\nYou are terse.{1}\n{0}user\nHello there!  How are you?{1}\n{0}assistant\n",
    "{1}{0}{0} leading and trailing spaces {1} x{1}\n\n{0}",
)


class PieceCodec(Protocol):
    """Text without special tokens to ids: `short` for small pieces, `long` for large ones."""

    def short(self, text: str) -> list[int]: ...

    def long(self, text: str) -> list[int]: ...


class _EnginePieces:
    """The engine's tokenizer as a PieceCodec (holds the GIL; its word cache is shared)."""

    def __init__(self, tokenizer: PromptCodec) -> None:
        self._tokenizer = tokenizer

    def short(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    long = short


class PromptTokenizer:
    """Wraps the engine's tokenizer; results equal its `encode(text, add_special_tokens)` exactly.

    Segmenting is on only when every added token of tokenizer.json is matched verbatim
    (no lstrip/rstrip/single_word/normalized flags) and a self-check against whole-text encoding
    passes; otherwise only whole texts are cached. At most `max_cached_tokens` are kept (LRU over
    all tenants: one tenant's traffic can evict another's entries, never hit them).
    Thread-safe: the server encodes on worker threads; long pieces release the GIL.
    """

    def __init__(self, tokenizer: PromptCodec, model_dir: str | Path | None,
                 max_cached_tokens: int = 1 << 20, num_threads: int = 1) -> None:
        self._tokenizer = tokenizer
        self._file = TokenizerFile(model_dir, num_encoders=num_threads)
        self._max_cached_tokens = max_cached_tokens
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], array] = OrderedDict()  # (tenant, piece)
        self._num_cached_tokens = 0
        self.num_hits = 0
        self.num_misses = 0
        self._special_ids: dict[str, int] = {}
        self._pattern: re.Pattern[str] | None = None
        self._engine_pieces = _EnginePieces(tokenizer)
        self._off_gil = self._file.has_encoder and self._plain_encoders_agree()
        specials = self._file.verbatim_added_tokens
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

    def min_num_tokens(self, num_chars: int) -> int:
        """A lower bound on the tokens of any prompt of `num_chars` characters (0: unknown),
        for refusing an over-long prompt before spending time on tokenizing it."""
        return self._file.min_num_tokens(num_chars)

    def encode(self, text: str, add_special_tokens: bool = True, tenant: str = "") -> list[int]:
        """Exactly `tokenizer.encode(text, add_special_tokens)`, from `tenant`'s cache where
        possible ("" is the shared default tenant, as in the engine's cache namespaces)."""
        if add_special_tokens and self._affixes is None:
            return list(self._tokenizer.encode(text, add_special_tokens=True))
        ids: list[int] = []
        with self._pieces() as pieces:
            if self._pattern is None:
                ids.extend(self._segment(text, tenant, pieces))
            else:
                for i, piece in enumerate(self._pattern.split(text)):
                    if i % 2:  # odd pieces are the separators: special tokens
                        ids.append(self._special_ids[piece])
                    elif piece:
                        ids.extend(self._segment(piece, tenant, pieces))
        if add_special_tokens:
            assert self._affixes is not None
            prefix, suffix = self._affixes
            return [*prefix, *ids, *suffix]
        return ids

    def num_uncached_chars(self, text: str, tenant: str = "") -> int:
        """Characters of `text` that `encode` would hand to the tokenizer now (not in
        `tenant`'s cache), for deciding where to encode it."""
        pieces = [text] if self._pattern is None else self._pattern.split(text)[::2]
        with self._lock:
            return sum(len(p) for p in pieces
                       if len(p) < _MIN_CACHED_CHARS or (tenant, p) not in self._cache)

    def _pieces(self) -> AbstractContextManager[PieceCodec]:
        """The encoder of one prompt: the server's own (GIL released, no word cache shared with
        other requests) where it agrees with the engine's tokenizer, else the engine's."""
        return self._file.checkout() if self._off_gil else nullcontext(self._engine_pieces)

    def _segment(self, piece: str, tenant: str, pieces: PieceCodec) -> list[int] | array:
        if len(piece) < _MIN_CACHED_CHARS:
            return pieces.short(piece)
        key = (tenant, piece)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return hit
            self.num_misses += 1
        ids = array("i", pieces.long(piece))
        if len(ids) <= self._max_cached_tokens:
            with self._lock:
                if key not in self._cache:  # another thread may have encoded it meanwhile
                    self._cache[key] = ids
                    self._num_cached_tokens += len(ids)
                while self._num_cached_tokens > self._max_cached_tokens:
                    _, old = self._cache.popitem(last=False)
                    self._num_cached_tokens -= len(old)
        return ids

    def _plain_encoders_agree(self) -> bool:
        for template in _SELF_CHECK_TEXTS:
            text = template.format("<s>", "</s>") * 3
            expected = list(self._tokenizer.encode(text, add_special_tokens=False))
            with self._file.checkout() as pieces:
                agree = pieces.long(text) == expected and pieces.short(text) == expected
            if not agree:
                logger.warning("tokenizer.json loaded by the server disagrees with the engine's "
                               "tokenizer; long prompts are tokenized holding the GIL")
                return False
        return True

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
