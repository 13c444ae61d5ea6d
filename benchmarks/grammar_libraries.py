"""Grammar libraries compared for structured outputs: build time and the cost of one token's mask.

For each tokenizer (the tiny model's 8k BPE, and a byte-level BPE of Qwen's size trained here on
the shipped text plus generated words, since no real 150k tokenizer is on these machines) and each
library (``llguidance``, ``xgrammar``, ``outlines_core``) this compiles one JSON schema (types,
enums, ``maxLength``, an array, no extra keys), then walks the tokens of a valid document: per
token, the next-token bitmask is computed, then the token consumed. Reported: the tokenizer's
set-up once, the schema's compile, and microseconds per token (p50, mean, max) for the mask and
for the advance. Whether each imports without torch is recorded too (kvengine has no torch at
run time). xgrammar's masks are torch tensors, so its row needs torch installed.

    python -m benchmarks.grammar_libraries [--vocab tiny,150k] [--libraries llguidance,...]
                                           [--reps 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from benchmarks.common import command, machine_info, now_iso, today, write_result

LIBRARIES = ("llguidance", "xgrammar", "outlines_core")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "enum": ["Paris", "Zürich", "Tokyo", "New York"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"], "additionalProperties": False},
    },
    "required": ["name", "city", "age", "tags", "score", "active", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace of the analytical engine", "city": "Zürich", "age": 36,
            "tags": ["math", "poetry", "engines"], "score": 97.25, "active": True,
            "address": {"street": "12 St James's Square", "zip": "10115"}}
BIG_VOCAB_SIZE = 151_643  # Qwen2/Qwen3's BPE vocabulary before its added tokens


def tokenizer_json(name: str) -> str:
    """tokenizer.json text of ``tiny`` (make-model's) or ``150k`` (trained here, ~8 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from engine.make_model import SPECIAL_TOKENS, corpus_texts, train_tokenizer

    if name == "tiny":
        return train_tokenizer().to_str()
    if name != "150k":
        raise ValueError(f"unknown vocabulary {name!r}")
    rng = np.random.default_rng(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("aeiou")
    words = ["".join(syllables[i] for i in rng.integers(0, len(syllables), rng.integers(2, 6)))
             for _ in range(400_000)]
    texts = corpus_texts() + [" ".join(words[i:i + 200]) for i in range(0, len(words), 200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=BIG_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok.to_str()


def imports_without_torch(module: str) -> bool:
    """Whether ``import module`` works in a fresh interpreter where torch cannot be imported."""
    code = f"import sys; sys.modules['torch'] = None; import {module}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


class _Walk:
    """One library's matcher over one compiled schema: ``mask()`` then ``advance(token)``."""

    mask: Callable[[], None]
    advance: Callable[[int], None]


def _llguidance(tok_json: str, vocab: int, eos: int) -> tuple[Callable, Callable]:
    import llguidance
    import llguidance.numpy as lln

    tokenizer = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)

    def compile_(schema: dict) -> _Walk:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        bitmask = lln.allocate_token_bitmask(1, vocab)
        walk = _Walk()
        walk.mask = lambda: lln.fill_next_token_bitmask(matcher, bitmask, 0)
        walk.advance = lambda t: _check(matcher.consume_token(t), matcher.get_error)
        return walk

    return tokenizer, compile_


def _xgrammar(tok_json: str, vocab: int, eos: int) -> tuple[Callable, Callable]:
    import xgrammar
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok_json))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile_(schema: dict) -> _Walk:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                               separators=(",", ":"))
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        walk = _Walk()
        walk.mask = lambda: matcher.fill_next_token_bitmask(bitmask, 0)
        walk.advance = lambda t: _check(matcher.accept_token(t), lambda: "rejected")
        return walk

    return compiler, compile_


def _outlines(tok_json: str, vocab: int, eos: int) -> tuple[Callable, Callable]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    vocabulary = Vocabulary(eos, _token_bytes(tok_json, eos))
    bitmask = np.zeros(-(-vocab // 32), dtype=np.int32)

    def compile_(schema: dict) -> _Walk:
        guide = Guide(Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"), vocabulary))
        walk = _Walk()
        walk.mask = lambda: guide.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)
        walk.advance = lambda t: guide.advance(t, return_tokens=False)
        return walk

    return vocabulary, compile_


def _token_bytes(tok_json: str, eos: int) -> dict[bytes, list[int]]:
    """Byte-level BPE tokens as their bytes (GPT-2's byte-to-unicode map undone)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    model = json.loads(tok_json)
    specials = {t["content"] for t in model.get("added_tokens", [])}
    out: dict[bytes, list[int]] = {}
    for text, token_id in model["model"]["vocab"].items():
        if text in specials or token_id == eos:
            continue
        out.setdefault(bytes(chars[c] for c in text), []).append(token_id)
    return out


def _check(ok: bool, error: Callable[[], str]) -> None:
    if not ok:
        raise RuntimeError(f"the grammar refused a token of the document: {error()}")


SETUPS = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines_core": _outlines}


def measure(library: str, tok_json: str, reps: int) -> dict:
    """Set-up, compile and per-token times of ``library`` on one tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    eos = tok.token_to_id("<|im_end|>")
    tokens = tok.encode(json.dumps(DOCUMENT, ensure_ascii=False, separators=(",", ":")),
                        add_special_tokens=False).ids
    start = time.perf_counter()
    _, compile_ = SETUPS[library](tok_json, vocab, eos)
    setup_s = time.perf_counter() - start
    compile_ms, mask_us, advance_us = [], [], []
    for _ in range(reps):
        start = time.perf_counter()
        walk = compile_(SCHEMA)
        compile_ms.append((time.perf_counter() - start) * 1e3)
        for token in tokens:
            t0 = time.perf_counter()
            walk.mask()
            t1 = time.perf_counter()
            walk.advance(token)
            t2 = time.perf_counter()
            mask_us.append((t1 - t0) * 1e6)
            advance_us.append((t2 - t1) * 1e6)
    return {"library": library, "vocab_size": vocab, "num_tokens": len(tokens),
            "setup_s": round(setup_s, 3), "compile_ms": round(statistics.median(compile_ms), 2),
            "mask_us": _summary(mask_us), "advance_us": _summary(advance_us)}


def _summary(values: list[float]) -> dict:
    return {"p50": round(statistics.median(values), 1),
            "mean": round(statistics.fmean(values), 1), "max": round(max(values), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grammar_libraries",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", default="tiny,150k", help="tiny and/or 150k")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--reps", type=int, default=3, help="documents walked per library")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="cpu")
    args = parser.parse_args(argv)
    libraries = args.libraries.split(",")
    unknown = set(libraries) - set(LIBRARIES)
    if unknown:
        parser.error(f"unknown libraries {sorted(unknown)}; choose from {LIBRARIES}")
    rows = []
    torch_free = {lib: imports_without_torch(lib) for lib in libraries}
    for vocab_name in args.vocab.split(","):
        tok_json = tokenizer_json(vocab_name)
        for library in libraries:
            try:
                importlib.import_module(library)
            except ImportError as exc:
                rows.append({"library": library, "vocab": vocab_name, "error": str(exc)})
                continue
            row = {"vocab": vocab_name, **measure(library, tok_json, args.reps),
                   "imports_without_torch": torch_free[library]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    versions = {}
    for library in libraries:
        try:
            from importlib.metadata import version

            versions[library] = version(library.replace("_", "-"))
        except Exception:  # noqa: BLE001 (not installed: no version)
            versions[library] = None
    result = {"command": command("python -m benchmarks.grammar_libraries", argv),
              "when": now_iso(), "machine": machine_info(), "versions": versions,
              "schema": SCHEMA, "rows": rows}
    path = write_result(args.out, f"grammar_libraries-{args.name}-{today()}.json", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
