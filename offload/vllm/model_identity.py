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


# The KV cache specs the connector serves, by exact class name (no vLLM import needed to read
# them; a subclass may change what a block holds, so it is refused until it is checked): full
# attention, sliding-window layers that vLLM allocates as full attention (a ``FullAttentionSpec``
# with ``sliding_window`` set: vLLM's hybrid KV cache manager is off for connectors without
# ``SupportsHMA``, so Gemma-style mixed models keep every block of every layer), and MLA's one
# latent cache per layer.
SERVED_SPECS = {"FullAttentionSpec": "full", "MLAAttentionSpec": "mla"}
# Why the others are refused, one line each (the first match along the spec's MRO wins).
REFUSED_SPECS = {
    "SlidingWindowSpec": "every layer slides, so vLLM frees a running request's blocks outside "
                         "the window while a save of them may still be in flight",
    "ChunkedLocalAttentionSpec": "vLLM frees a running request's blocks outside the chunk "
                                 "while a save of them may still be in flight",
    "MambaSpec": "its layers keep a recurrent state per request, not per-token blocks that a "
                 "prefix of tokens names (and vLLM runs them only with its hybrid KV cache "
                 "manager)",
}


def spec_kind(spec: Any) -> str:
    """The served kind of a KV cache spec (``full``, ``sliding`` or ``mla``); ValueError with
    the reason for a spec the connector does not serve."""
    name = type(spec).__name__
    kind = SERVED_SPECS.get(name)
    if kind == "full" and getattr(spec, "sliding_window", None):
        return "sliding"
    if kind is not None:
        return kind
    reason = next((REFUSED_SPECS[c.__name__] for c in type(spec).__mro__
                   if c.__name__ in REFUSED_SPECS),
                  "not plain attention KV of whole blocks of tokens (unchecked)")
    raise ValueError(f"KVStoreConnector does not serve {name} layers: {reason}")


def kv_signature(device_type: str, layout: str, spec: Any) -> str:
    """The KV format part of the identity: platform, layout, heads and head sizes, and for
    anything but plain full attention its kind (``mla``, ``sw<window>``), so the keys of full
    attention stay those they always were."""
    signature = (f"{device_type}:{layout}:kvheads{spec.num_kv_heads}:"
                 f"head{spec.head_size}/{getattr(spec, 'head_size_v', spec.head_size)}")
    kind = spec_kind(spec)
    if kind == "mla":
        signature += ":mla"
    elif kind == "sliding":
        signature += f":sw{int(spec.sliding_window)}"
    return signature


def identity_from_config(vllm_config: VllmConfig, kv_cache_config: Any) -> ModelIdentity:
    """The identity of the model vLLM serves; ValueError, with the reason, for a model the
    connector does not serve (more than one KV cache group, a refused spec: ``spec_kind``).

    Under pipeline parallelism each stage's config names only its own layers: the identity
    counts the model's layers, so every stage (and the scheduler) derive the same namespace."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise ValueError(f"KVStoreConnector serves models with one KV cache group (vLLM's "
                         f"hybrid KV cache manager off); this one has {len(groups)} "
                         f"({', '.join(kinds)})")
    spec = groups[0].kv_cache_spec
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or cc.kv_cache_layout or "default"
    from vllm.platforms import current_platform

    signature = kv_signature(current_platform.device_type, layout, spec)
    arch = (getattr(mc.hf_config, "architectures", None) or [mc.architecture])[0]
    num_layers = len(groups[0].layer_names)
    if int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)) > 1:
        num_layers = int(mc.get_total_num_hidden_layers())
    return vllm_identity(
        str(arch), num_layers=num_layers, num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size), kv_dtype=str(spec.dtype).removeprefix("torch."),
        block_size=int(spec.block_size),
        weights_id=weights_identity(str(mc.model), getattr(mc, "revision", None)),
        kv_format=signature)
