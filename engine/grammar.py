"""Grammar-constrained decoding with llguidance: a request's constraint compiled into a matcher
that says which tokens may come next, advanced with each accepted token.

``GrammarCompiler`` is engine-wide: llguidance's view of the model's vocabulary (built once, at
the first constrained request: 0.6 s at 150k tokens) and the JSON options. ``GrammarMatcher`` is
one request's state. ``MaskFiller`` writes the next-token bitmasks of a step's constrained rows
(int32 ``[rows, ceil(V / 32)]``, bit ``v % 32`` of word ``v // 32`` set when token ``v`` is
allowed; ``kernels.reference.apply_token_bitmask`` applies it), several rows on llguidance's own
threads. Why llguidance: docs/agents.md.

End of a constrained output: eos is in the mask only while the grammar accepts what was generated,
and once the grammar can take nothing more (``is_finished``) the engine ends the request.

Thinking first (``StructuredOutputsParams.reasoning_end``): the matcher starts in
``GrammarPhase.REASONING``, where tokens are neither masked nor consumed, and moves to
``CONSTRAINED`` when the end-of-reasoning token is generated; its grammar then takes up to two
newlines before the answer (Qwen3 writes ``</think>\n\n``). A prompt that already ends the
reasoning (the token, then only whitespace: Qwen3's template with ``enable_thinking`` false)
starts ``CONSTRAINED`` with the plain grammar.
"""

from __future__ import annotations

import enum
import json
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from engine.strict_schema import strict_schema
from engine.structured_outputs import GrammarKind, StructuredOutputsParams

# JSON as json.dumps and chat templates' tojson write it (", " and ": ", no other whitespace):
# a weak model cannot wander into endless whitespace, and a tool call generated under a grammar
# reads back through the chat template as the same text (the next turn's prefix hits the cache).
# A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Between the end of the reasoning and the answer: what Qwen3's template writes after </think>,
# and no more (a weak model must not wander into whitespace here either).
SEPARATOR = r"/\n{0,2}/"
# The prompt ends the reasoning when the marker is among its last tokens, only whitespace after.
PROMPT_TAIL_TOKENS = 8


class GrammarPhase(str, enum.Enum):
    """Where a request's output stands with its grammar."""

    REASONING = "reasoning"  # free: no mask, nothing consumed, until the reasoning's end token
    CONSTRAINED = "constrained"  # every token masked by the grammar and consumed by it


class GrammarMatcher:
    """One request's grammar state: ``advance`` with each generated token; its mask applies
    while ``is_active``.

    With ``reasoning_end_id`` it starts in ``REASONING`` and moves to ``CONSTRAINED`` (the one
    transition) when that token is generated; the grammar starts at the token after it.
    """

    def __init__(self, matcher: object, reasoning_end_id: int | None = None) -> None:
        self._matcher = matcher
        self._reasoning_end_id = reasoning_end_id
        self.phase = (GrammarPhase.CONSTRAINED if reasoning_end_id is None
                      else GrammarPhase.REASONING)

    def fresh_copy(self) -> GrammarMatcher:
        """An independent matcher at this one's start (llguidance's ``deep_copy``: ~10 us where
        compiling took up to seconds); call before any token was fed."""
        return GrammarMatcher(self._matcher.deep_copy(), self._reasoning_end_id)

    @property
    def is_active(self) -> bool:
        """The grammar masks the next token (False while the reasoning runs)."""
        return self.phase is GrammarPhase.CONSTRAINED

    def accept(self, token_id: int) -> bool:
        """Feed one token to the grammar; False when it does not allow it (the matcher then
        stays in an error state and ``is_finished`` is true)."""
        return bool(self._matcher.consume_token(int(token_id)))

    def advance(self, token_id: int) -> bool:
        """Take one generated token (the grammar ``accept``s it once active); True when the
        output is now over (``is_finished``)."""
        if self.phase is GrammarPhase.REASONING:
            if token_id == self._reasoning_end_id:
                self.phase = GrammarPhase.CONSTRAINED
            return False
        self.accept(token_id)
        return self.is_finished

    @property
    def is_finished(self) -> bool:
        """Nothing more can follow (the grammar is complete, or broken by a refused token)."""
        return bool(self._matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        """What was generated so far is a complete match (eos is allowed now)."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str:
        """Why the matcher is broken ("" while it is not)."""
        return str(self._matcher.get_error())

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of ``bitmask`` := the tokens the grammar allows next (``MaskFiller``'s
        layout). The GIL is released while llguidance computes."""
        import llguidance.numpy as lln

        lln.fill_next_token_bitmask(self._matcher, bitmask, row)

    @staticmethod
    def fill_masks(matchers: Sequence[GrammarMatcher], bitmask: np.ndarray,
                   executor: object) -> None:
        """Row ``i`` of ``bitmask`` := the allowed tokens of ``matchers[i]``, the rows computed
        at once on ``executor``'s threads (an ``llguidance.LLExecutor``)."""
        import llguidance.numpy as lln

        lln.fill_next_token_bitmask_par(
            executor, [(m._matcher, i) for i, m in enumerate(matchers)], bitmask)


class ModelTokenizer(Protocol):
    """What the compiler reads of the engine's tokenizer (engine.tokenizer.Tokenizer)."""

    eos_token_ids: tuple[int, ...]

    def to_json(self) -> str:
        """tokenizer.json text."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``."""
        ...


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` into matchers over one model's vocabulary.

    ``vocab_size``: the rows of the model's logits (ids past the tokenizer's are never allowed);
    the tokenizer's eos ids may end a complete match. Thread-safe.
    """

    def __init__(self, tokenizer: ModelTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._llg: object | None = None
        self._marker_ids: dict[str, int] = {}  # reasoning end markers, encoded once each

    def _llg_tokenizer(self) -> object:
        with self._lock:
            if self._llg is None:
                import llguidance

                text = self._tokenizer.to_json()
                self._llg = llguidance.LLTokenizer(
                    text, n_vocab=max(self.vocab_size, _num_tokens(text)),
                    eos_token=list(self._tokenizer.eos_token_ids) or None)
            return self._llg

    def grammar(self, params: StructuredOutputsParams) -> str:
        """llguidance's grammar text for ``params``; ValueError for an unreadable schema."""
        import llguidance

        matcher_cls = llguidance.LLMatcher
        kind = params.kind
        try:
            if kind is GrammarKind.JSON:  # objects closed unless they say otherwise (vLLM's way)
                return matcher_cls.grammar_from_json_schema(
                    strict_schema(json.loads(params.json)), defaults=JSON_OPTIONS)
            if kind is GrammarKind.JSON_OBJECT:
                return matcher_cls.grammar_from_json_schema({"type": "object"},
                                                            defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json: not a JSON schema: {exc}") from None
        if kind is GrammarKind.REGEX:
            return matcher_cls.grammar_from_regex(params.regex)
        if kind is GrammarKind.CHOICE:
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return matcher_cls.grammar_from_lark(f"start: {alternatives}\n")
        return matcher_cls.grammar_from_lark(params.grammar)

    def matcher(self, params: StructuredOutputsParams | None,
                prompt_token_ids: Sequence[int] = ()) -> GrammarMatcher | None:
        """A fresh matcher at the start of the output (None without params); ValueError (naming
        the field and what llguidance found wrong) for a schema, regex or grammar it cannot
        compile, or a ``reasoning_end`` that is not one token. ``prompt_token_ids`` tell
        whether the prompt already ended the reasoning."""
        if params is None:
            return None
        import llguidance

        grammar = self.grammar(params)
        end_id = None
        if params.reasoning_end is not None:
            end_id = self._one_token(params.reasoning_end)
            if self._prompt_ends_reasoning(prompt_token_ids, end_id):
                end_id = None  # constrained from the first token, with the plain grammar
            else:
                grammar = _after_separator(grammar)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind.value}: "
                             f"{_first_lines(matcher)}")
        return GrammarMatcher(matcher, end_id)

    def request_matcher(self, params: StructuredOutputsParams | None,
                        prompt_token_ids: Sequence[int],
                        compiled: GrammarMatcher | None = None) -> GrammarMatcher | None:
        """The matcher a new request starts with: a fresh copy of ``compiled`` (``matcher``'s
        result for the same params and prompt), else one compiled now."""
        if params is None:
            return None
        return compiled.fresh_copy() if compiled is not None else \
            self.matcher(params, prompt_token_ids)

    def _one_token(self, marker: str) -> int:
        found = self._marker_ids.get(marker)
        if found is not None:
            return found
        ids = self._tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"structured_outputs.reasoning_end: {marker!r} is not one token of "
                             f"this model's vocabulary (it encodes to {len(ids)} tokens)")
        self._marker_ids[marker] = int(ids[0])
        return int(ids[0])

    def _prompt_ends_reasoning(self, prompt_token_ids: Sequence[int], end_id: int) -> bool:
        tail = [int(t) for t in prompt_token_ids[-PROMPT_TAIL_TOKENS:]]
        if end_id not in tail:
            return False
        after = tail[len(tail) - tail[::-1].index(end_id):]
        return not self._tokenizer.decode(after, skip_special_tokens=False).strip()


class MaskFiller:
    """Fills a step's bitmask rows from the matchers, on llguidance's threads when several."""

    def __init__(self) -> None:
        self._executor: object | None = None

    def fill(self, matchers: list[GrammarMatcher], bitmask: np.ndarray) -> None:
        """Row ``i`` of ``bitmask`` (C-contiguous int32) := the allowed tokens of
        ``matchers[i]``. The GIL is released while llguidance computes."""
        if len(matchers) == 1:
            matchers[0].fill_mask(bitmask, 0)
            return
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        GrammarMatcher.fill_masks(matchers, bitmask, self._executor)


def _after_separator(grammar: str) -> str:
    """``grammar`` (Lark text, or llguidance's JSON form, whose first grammar is the start)
    behind ``SEPARATOR``, as one grammar in llguidance's JSON form."""
    if grammar.lstrip().startswith("{"):
        top = json.loads(grammar)
        first, *others = top["grammars"]
    else:
        top, first, others = {}, {"lark_grammar": grammar}, []
    name = first.get("name") or "answer"
    start = {"lark_grammar": f"start: {SEPARATOR} @{name}"}
    return json.dumps({**top, "grammars": [start, {**first, "name": name}, *others]})


def _num_tokens(tokenizer_json: str) -> int:
    """Ids the tokenizer.json defines (its model's vocabulary and its added tokens)."""
    data = json.loads(tokenizer_json)
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # Unigram: list
    ids += [token.get("id") for token in data.get("added_tokens") or []]
    return max([i for i in ids if isinstance(i, int)] or [-1]) + 1


def _first_lines(matcher: object, num_lines: int = 6) -> str:
    text = str(matcher.get_error()).strip()
    return "\n".join(text.splitlines()[:num_lines])
