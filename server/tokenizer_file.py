"""TokenizerFile: what the server reads from a model's tokenizer.json, and a GIL-free encoder.

The `tokenizers` binding holds the GIL for the whole of `Tokenizer.encode`, so a long prompt
encoded on a worker thread still stops the event loop (1 s for 1 MB of text); `encode_batch`
releases it while the Rust code runs. The server uses its own `tokenizers.Tokenizer`s loaded from
the same file as the engine's, and checks that they give the same ids before relying on them.

A BPE model keeps a word cache shared by every call (the first 10,000 words it meets), which
would let one tenant time whether another sent a rare word. Each prompt is encoded by an
encoder of its own (`checkout`), whose word cache is cleared first: words repeated inside a
prompt still hit, nothing carries over from another request.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvengine.server")

# Unicode normalization can shrink text (NFKC composes a base and its combining marks, Hangul jamo
# into a syllable: about 3 characters into 1), so the character bound gets this much slack. Other
# normalizers and pre-tokenizers can drop characters outright (Strip, Whitespace, a Split that
# removes its matches): with them no character bound holds and the early check is off.
_NORMALIZER_SLACK = 4
_UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"})


class TokenizerFile:
    """The parts of tokenizer.json the server needs; every field has a safe empty value when the
    file is missing or unreadable (no segmenting, no early length bound, the engine's encoder).
    `num_encoders`: how many threads will encode at once (more are made when needed)."""

    def __init__(self, model_dir: str | Path | None, num_encoders: int = 1) -> None:
        self.verbatim_added_tokens: dict[str, int] = {}
        self.max_chars_per_token: int | None = None
        self._spec_text: str | None = None
        self._lock = threading.Lock()
        self._idle: list[PieceEncoder] = []
        if model_dir is None:
            return
        path = Path(model_dir) / "tokenizer.json"
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(spec, dict):
            return
        self.verbatim_added_tokens = _verbatim_added_tokens(spec.get("added_tokens") or [])
        self.max_chars_per_token = _max_chars_per_token(spec)
        try:
            from tokenizers import Tokenizer

            self._spec_text = path.read_text()
            # One per thread that encodes at once, made now: building one takes up to 0.2 s.
            self._idle += [PieceEncoder(Tokenizer.from_str(self._spec_text))
                           for _ in range(max(1, num_encoders))]
        except Exception as exc:  # noqa: BLE001 - any failure means: use the engine's encoder
            logger.warning("cannot load %s for encoding off the GIL: %s", path, exc)
            self._spec_text = None

    @property
    def has_encoder(self) -> bool:
        """True when `checkout` gives encoders (the file loaded into `tokenizers`)."""
        return self._spec_text is not None

    @contextmanager
    def checkout(self) -> Iterator[PieceEncoder]:
        """An encoder for one prompt, used by nobody else meanwhile, its word cache empty."""
        assert self._spec_text is not None
        with self._lock:
            encoder = self._idle.pop() if self._idle else None
        if encoder is None:  # one per thread encoding at once: the loop and the pool's workers
            from tokenizers import Tokenizer

            encoder = PieceEncoder(Tokenizer.from_str(self._spec_text))
        encoder.forget()
        try:
            yield encoder
        finally:
            with self._lock:
                self._idle.append(encoder)

    def min_num_tokens(self, num_chars: int) -> int:
        """A lower bound on the tokens of any text of `num_chars` characters (0: unknown).

        Sound because every token covers at most `max_chars_per_token` characters of its
        vocabulary's alphabet, and an input character is at least one of those (a byte-level
        vocabulary spells each UTF-8 byte as one character)."""
        if not self.max_chars_per_token:
            return 0
        return num_chars // self.max_chars_per_token


class PieceEncoder:
    """One `tokenizers.Tokenizer`: text without special tokens to ids."""

    _warned = False

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        model = tokenizer.model
        # `_clear_cache` came with tokenizers 0.21; older ones keep the shared word cache.
        self._clear = model._clear_cache if hasattr(model, "_clear_cache") else None
        if self._clear is None and not PieceEncoder._warned:
            PieceEncoder._warned = True
            logger.warning("this tokenizers version cannot clear its word cache: requests can "
                           "time whether rare words were sent before (tokenizers>=0.21 can)")

    def forget(self) -> None:
        """Empty the word cache (a few microseconds)."""
        if self._clear is not None:
            self._clear()

    def short(self, text: str) -> list[int]:
        """Ids of a short text (holding the GIL costs less than releasing it)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def long(self, text: str) -> list[int]:
        """Ids of a long text, computed with the GIL released."""
        return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


def _max_chars_per_token(spec: dict[str, Any]) -> int | None:
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: piece -> id
        pieces = list(vocab)
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs
        pieces = [entry[0] for entry in vocab if isinstance(entry, list) and entry]
    else:
        return None
    pieces += [t.get("content", "") for t in spec.get("added_tokens") or [] if isinstance(t, dict)]
    longest = max((len(p) for p in pieces if isinstance(p, str)), default=0)
    normalizers = _steps(spec.get("normalizer"))
    if longest <= 0 or normalizers is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    if any(step.get("type") not in _UNICODE_NORMALIZERS for step in normalizers):
        return None
    return longest * (_NORMALIZER_SLACK if normalizers else 1)


def _steps(component: Any) -> list[dict[str, Any]] | None:
    """The steps of a normalizer or pre-tokenizer (a Sequence flattened); None if malformed."""
    if component is None:
        return []
    if not isinstance(component, dict):
        return None
    if component.get("type") != "Sequence":
        return [component]
    steps: list[dict[str, Any]] = []
    for part in component.get("normalizers") or component.get("pretokenizers") or []:
        inner = _steps(part)
        if inner is None:
            return None
        steps += inner
    return steps


def _keeps_characters(pre_tokenizer: Any) -> bool:
    steps = _steps(pre_tokenizer)
    return steps is not None and all(
        step.get("type") in _KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed"
        for step in steps)


def _verbatim_added_tokens(added: list[Any]) -> dict[str, int]:
    """content -> id of tokenizer.json's added tokens, or {} if any is not matched verbatim."""
    specials: dict[str, int] = {}
    for token in added:
        if not isinstance(token, dict):
            return {}
        if any(token.get(flag) for flag in ("lstrip", "rstrip", "single_word", "normalized")):
            return {}
        content = token.get("content")
        if not isinstance(content, str) or not content or not isinstance(token.get("id"), int):
            return {}
        specials[content] = token["id"]
    return specials
