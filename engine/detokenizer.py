"""Incremental detokenization of a request's output ids, with stop strings trimmed from the text."""

from __future__ import annotations

from engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Grows ``text`` as output ids arrive, decoding only a short window each time.

    Each update decodes ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``; the
    difference is the new text. Text ending in U+FFFD (half a UTF-8 character) is held back until
    the next token completes it. After a stop string matched, ``text`` ends just before it (just
    after it with ``include_stop_str``). ``skip_special_tokens`` False keeps special tokens' text.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] | None,
                 skip_special_tokens: bool = True, include_stop_str: bool = False) -> None:
        self._tokenizer = tokenizer
        self.stop = stop or ()
        self._skip_special_tokens = skip_special_tokens
        self._include_stop_str = include_stop_str
        self.text = ""
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = 0
        self._max_stop_chars = max((len(s) for s in self.stop), default=0)
        self.matched_stop: str | None = None  # the stop string that ended the text, once one did

    def update(self, output_ids: list[int], check_stop: bool = True) -> bool:
        """Take the ids generated so far; True when a stop string just matched. With
        ``check_stop`` False (before ``min_tokens``) the new text is not searched for them."""
        if self.stopped:
            return True
        skip = self._skip_special_tokens
        decode = self._tokenizer.decode
        prefix_text = decode(output_ids[self._prefix_offset : self._read_offset],
                             skip_special_tokens=skip)
        full_text = decode(output_ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return False
        old_len = len(self.text)
        self.text += full_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
        if self.stop and check_stop:
            # A stop string can only end in the new text: each is searched from its own length
            # before it, so a long one does not make every short one scan the whole text.
            text = self.text
            hits = [(i, s) for i, s in ((text.find(s, max(0, old_len - len(s) + 1)), s)
                                        for s in self.stop) if i >= 0]
            if hits:
                at, stop = min(hits, key=lambda hit: hit[0])
                self.text = self.text[: at + len(stop) if self._include_stop_str else at]
                self.stopped = True
                self.matched_stop = stop
        return self.stopped

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, the tail that could still begin a stop string is held
        back, so a streamed prefix is never taken back when the stop string completes."""
        if finished or not self._max_stop_chars:
            return self.text
        return self.text[: max(0, len(self.text) - (self._max_stop_chars - 1))]
