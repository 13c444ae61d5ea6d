"""``kvengine make-model``: a random-weight checkpoint in the HF folder format.

Writes config.json (Qwen3ForCausalLM), safetensors weights streamed tensor by tensor, a byte-level
BPE tokenizer.json trained with ``tokenizers`` on the text in engine/data/, tokenizer_config.json
(eos, bos, a ChatML chat template) and generation_config.json. Same preset + seed, same bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from engine.safetensors_writer import (
    SafetensorsWriter,
    TensorSpec,
    encode_values,
    plan_shards,
    shard_names,
    write_index,
)

DATA_DIR = Path(__file__).parent / "data"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 8192
MAX_SHARD_BYTES = 2 * 1024**3
INIT_STD = 0.02
# ChatML as Qwen3 writes it, without the thinking parts: tools (as JSON lines in the system
# turn), assistant tool calls as <tool_call> blocks, tool results as <tool_response> blocks in a
# user turn. A conversation without tools renders as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n"
    "</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['function'] %}{%- set call = call['function'] %}{%- endif %}"
    "{%- if (loop.first and message['content']) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}"
    "{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Shapes of the real Qwen3 checkpoints; "tiny" and "small" are for tests and smoke runs.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=None,
                 max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
                 dtype="float32"),
    # The smallest shape vLLM's CPU attention backend loads (it needs head_dim >= 32).
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=None,
                  max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=False,
                  dtype="float32"),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                       tie_word_embeddings=True, dtype="bfloat16"),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                     tie_word_embeddings=True, dtype="bfloat16"),
}


def corpus_texts() -> list[str]:
    """The shipped training text, one string per paragraph."""
    files = sorted(DATA_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no training text in {DATA_DIR}")
    return [p for f in files for p in f.read_text().split("\n\n") if p.strip()]


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2/Qwen style) with the ChatML special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_texts(), trainer)
    return tok


def model_config(preset: str, vocab_size: int, dtype: str, eos_ids: list[int]) -> dict:
    """config.json in the form Qwen3 checkpoints ship (top-level ``rope_theta``)."""
    p = PRESETS[preset]
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": p["hidden_size"], "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"], "head_dim": p["head_dim"],
        "vocab_size": vocab_size, "max_position_embeddings": p["max_position_embeddings"],
        "rope_theta": p["rope_theta"], "rope_scaling": None, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": p["tie_word_embeddings"], "use_sliding_window": False,
        "torch_dtype": dtype, "bos_token_id": eos_ids[-1], "eos_token_id": eos_ids,
        "initializer_range": INIT_STD,
    }


def tensor_specs(config: dict, dtype: str) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in file order (embedding, layer by layer, norm, head)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    specs = [TensorSpec("model.embed_tokens.weight", (config["vocab_size"], h), dtype)]
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (h,), dtype),
            TensorSpec(p + "self_attn.q_proj.weight", (q, h), dtype),
            TensorSpec(p + "self_attn.k_proj.weight", (kv, h), dtype),
            TensorSpec(p + "self_attn.v_proj.weight", (kv, h), dtype),
            TensorSpec(p + "self_attn.q_norm.weight", (d,), dtype),
            TensorSpec(p + "self_attn.k_norm.weight", (d,), dtype),
            TensorSpec(p + "self_attn.o_proj.weight", (h, q), dtype),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), dtype),
            TensorSpec(p + "mlp.gate_proj.weight", (i, h), dtype),
            TensorSpec(p + "mlp.up_proj.weight", (i, h), dtype),
            TensorSpec(p + "mlp.down_proj.weight", (h, i), dtype),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), dtype))
    if not config["tie_word_embeddings"]:
        specs.append(TensorSpec("lm_head.weight", (config["vocab_size"], h), dtype))
    return specs


def tensor_chunks(spec: TensorSpec, rng: np.random.Generator,
                  num_live_rows: int | None = None) -> Iterator[bytes]:
    """Norm weights are ones; matrices N(0, INIT_STD), generated a few rows at a time.

    Rows from ``num_live_rows`` on are zeros: for the output embedding those are ids the
    tokenizer does not have, and a zero row's logit (0) loses to the best of thousands of random
    ones, so greedy decoding of a random model yields ids that decode to visible text.
    """
    if len(spec.shape) == 1:
        yield encode_values(np.ones(spec.shape, dtype=np.float32), spec.dtype)
        return
    rows, cols = spec.shape
    live = rows if num_live_rows is None else num_live_rows
    step = max(1, (16 * 1024 * 1024) // cols)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        values = rng.standard_normal((n, cols), dtype=np.float32) * np.float32(INIT_STD)
        if start + n > live:
            values[max(0, live - start):] = 0.0
        yield encode_values(values, spec.dtype)


def _counted(chunks: Iterator[bytes], bar: tqdm) -> Iterator[bytes]:
    for chunk in chunks:
        bar.update(len(chunk))
        yield chunk


def write_checkpoint(out: Path, preset: str, seed: int, dtype: str | None = None,
                     progress: bool | None = False) -> None:
    """Write the whole folder; raises FileExistsError if ``out`` already holds a config.json.
    ``progress``: a bar of bytes written on stderr (None: only when stderr is a terminal)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    dtype = dtype or PRESETS[preset]["dtype"]
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a checkpoint (config.json)")
    tok = train_tokenizer()
    num_tokens = tok.get_vocab_size(with_added_tokens=True)
    vocab_size = PRESETS[preset]["vocab_size"] or -(-num_tokens // 64) * 64
    eos_ids = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    config = model_config(preset, vocab_size, dtype, eos_ids)
    specs = tensor_specs(config, dtype)
    shards = plan_shards(specs, MAX_SHARD_BYTES)
    names = shard_names(len(shards))
    rng = np.random.default_rng(seed)
    # disable=None is tqdm's "off unless a terminal": logs and pipes get no carriage returns.
    bar = tqdm(total=sum(spec.nbytes for spec in specs), unit="B", unit_scale=True,
               unit_divisor=1024, desc=f"writing {preset} weights", file=sys.stderr,
               disable=None if progress is None else not progress)
    output_embedding = ("model.embed_tokens.weight" if config["tie_word_embeddings"]
                        else "lm_head.weight")
    for shard, fname in zip(shards, names):
        writer = SafetensorsWriter(out / fname, shard)
        for spec in shard:
            live = num_tokens if spec.name == output_embedding else None
            writer.write(spec.name, _counted(tensor_chunks(spec, rng, live), bar))
        writer.close()
    bar.close()
    write_index(out, shards, names)
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", {"eos_token_id": eos_ids, "do_sample": False})
    _write_json(out / "config.json", config)  # last: its presence marks a complete checkpoint


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    summary = __doc__.split("\n")[0].replace("``", "")  # plain text in --help, not RST
    parser = argparse.ArgumentParser(prog="kvengine make-model", description=summary)
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS),
                        help="model shape; required, no default")
    parser.add_argument("--out", required=True, type=Path,
                        help="folder to write (created); required, no default")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="weights dtype (default: the preset's)")
    args = parser.parse_args(argv)
    try:
        write_checkpoint(args.out, args.preset, args.seed, args.dtype, progress=None)
    except (FileExistsError, ValueError) as exc:
        print(f"kvengine make-model: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.preset} checkpoint to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
