"""The ``ModelIdentity`` of a vLLM instance's model: kvstore's, built from vLLM's config.

It is kvengine's identity with two more things in its architecture: that the blocks are vLLM's
(``vllm:``) and what their bytes mean, the KV format (the platform's attention KV format, vLLM's
resolved layout, KV heads and head sizes), so vLLM's blocks never mix with kvengine's, nor a
CPU backend's with a flash-attention one's. The worker's tensors add their own signature to the
registration's meta.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.keys import ModelIdentity
from offload.external.block_keys import weights_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The architecture of a vLLM identity starts with this (kvengine's never do); the KV format
# follows the model's architecture after ``|``.
VLLM_ARCH_PREFIX = "vllm:"
_KV_FORMAT_SEPARATOR = "|"


def vllm_identity(architecture: str, num_layers: int, num_kv_heads: int, head_dim: int,
                  kv_dtype: str, block_size: int, weights_id: str,
                  kv_format: str) -> ModelIdentity:
    """The identity of a vLLM model whose blocks hold ``kv_format`` bytes."""
    return ModelIdentity(
        architecture=f"{VLLM_ARCH_PREFIX}{architecture}{_KV_FORMAT_SEPARATOR}{kv_format}",
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
        kv_dtype=kv_dtype, block_size=block_size, weights_id=weights_id)


def kv_format(identity: ModelIdentity) -> str:
    """The KV format a vLLM identity names (what ``vllm_identity`` was given)."""
    if not identity.architecture.startswith(VLLM_ARCH_PREFIX):
        raise ValueError(f"{identity.architecture!r} is not a vLLM identity")
    return identity.architecture.rpartition(_KV_FORMAT_SEPARATOR)[2]


def identity_from_config(vllm_config: VllmConfig, kv_cache_config: Any) -> ModelIdentity:
    """The identity of the model vLLM serves; ValueError for a model the connector does not
    support (more than one KV cache group, anything but full attention)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"KVStoreConnector supports models with one KV cache group (full "
                         f"attention in every layer); this one has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if getattr(spec, "sliding_window", None) or type(spec).__name__ != "FullAttentionSpec":
        raise ValueError(f"KVStoreConnector supports full attention only, not "
                         f"{type(spec).__name__}")
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or cc.kv_cache_layout or "default"
    from vllm.platforms import current_platform

    signature = (f"{current_platform.device_type}:{layout}:kvheads{spec.num_kv_heads}:"
                 f"head{spec.head_size}/{getattr(spec, 'head_size_v', spec.head_size)}")
    arch = (getattr(mc.hf_config, "architectures", None) or [mc.architecture])[0]
    return vllm_identity(
        str(arch), num_layers=len(groups[0].layer_names), num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size), kv_dtype=str(spec.dtype).removeprefix("torch."),
        block_size=int(spec.block_size),
        weights_id=weights_identity(str(mc.model), getattr(mc, "revision", None)),
        kv_format=signature)
