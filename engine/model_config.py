"""The model's shape, read from an HF ``config.json``; unsupported architectures fail here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this engine does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope_type`` "default", "linear" or "llama3"."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to know about the checkpoint's shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    dtype: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @classmethod
    def load(cls, model_dir: str | Path) -> ModelConfig:
        """Parse ``model_dir/config.json``; raise FileNotFoundError or UnsupportedModelError."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {str(model_dir)!r}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json (both ``rope_theta`` and ``rope_parameters`` forms)."""
        architectures = d.get("architectures") or []
        if not architectures:
            raise UnsupportedModelError("config.json names no architecture ('architectures')")
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; supported: {supported}")
        _check_full_attention(d)
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {d['hidden_act']!r}; need 'silu'")
        try:
            num_heads = int(d["num_attention_heads"])
            hidden_size = int(d["hidden_size"])
            config = cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d["max_position_embeddings"]),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                # Qwen2 always has q/k/v biases; Llama and Qwen3 follow attention_bias.
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
                o_bias=arch != "Qwen2ForCausalLM" and bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                rope=_parse_rope(d),
                dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
                eos_token_ids=_int_tuple(d.get("eos_token_id")),
                bos_token_id=d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int)
                else None,
            )
        except KeyError as exc:
            raise ValueError(f"config.json lacks required field {exc.args[0]!r}") from None
        config._validate()
        return config

    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("config.json: num_attention_heads must be a multiple of "
                             "num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("config.json: head_dim must be even for rotary embeddings")


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _check_full_attention(d: dict[str, Any]) -> None:
    layer_types = d.get("layer_types") or []
    if d.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError("sliding-window attention layers are not supported")


def _parse_rope(d: dict[str, Any]) -> RopeConfig:
    """``rope_parameters: {rope_theta, rope_type, ...}`` (newer) or ``rope_theta`` +
    ``rope_scaling`` (older); the newer form wins where both are present."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    if not isinstance(params, dict):
        params = d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    original = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original is not None else None,
    )
