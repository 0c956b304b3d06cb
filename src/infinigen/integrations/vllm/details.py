"""The vLLM details the plugin relies on beyond its public extension points, in one place, with
the release they were read in and checked against (`TESTED`). A vLLM outside that range is
refused when the plugin turns on, not met halfway.

- The Llama family's module tree: ``model.model.layers[i].self_attn`` takes ``(positions,
  hidden_states)`` (the normalized input), has ``rotary_emb`` (its ``forward_native(positions,
  query)``) and ``attn`` (the `Attention` layer, whose ``layer_name`` the backend sees).
- The page vLLM hands the backend: ``[blocks, KV heads, block_size, C]`` in the spec's dtype,
  C the spec's ``state_content_bytes`` (`AttentionSpec.customize_spec`), last dimension
  contiguous.
- `CommonAttentionMetadata`'s ``query_start_loc``, ``seq_lens``, ``block_table_tensor`` and
  ``slot_mapping``.
"""

from __future__ import annotations

import re

import torch

from infinigen.errors import InputError

TESTED = (">=0.32.0,<0.33", (0, 32), (0, 33))
ARCHITECTURES = ("LlamaForCausalLM",)  # served with the speculation hooks (SmolLM2 is one)
_LAYER = re.compile(r"layers\.(\d+)\.")


class UnsupportedVllmError(InputError):
    """A vLLM release, model or engine setting the plugin does not serve."""


def check_version(version: str) -> None:
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    low, high = TESTED[1], TESTED[2]
    if not (low <= parts < high):
        raise UnsupportedVllmError(
            f"infinigen's vLLM plugin was checked against vllm {TESTED[0]}; this is {version}: "
            "install a release in that range (pip install 'infinigen-kv[vllm]')"
        )


def layer_index(layer_name: str) -> int:
    """The decoder layer of an attention layer's name (``model.layers.3.self_attn.attn`` -> 3)."""
    match = _LAYER.search(layer_name)
    if match is None:
        raise UnsupportedVllmError(f"cannot tell the layer of vLLM attention layer {layer_name!r}")
    return int(match.group(1))


def attention_modules(model) -> list:
    """Each decoder layer's attention module (the one whose input the speculation reads)."""
    return [layer.self_attn for layer in model.model.layers]


def rotary(attention_module):
    """The layer's rotary embedding as ``f(positions, query [T, H·d]) -> query`` (float32 kept)."""
    emb = attention_module.rotary_emb

    def apply(positions, query):
        q, _ = emb.forward_native(positions, query)
        return q

    return apply


def rope_table(attention_module):
    """The layer's rotary table as the plugin's kernel applies it, (cos_sin [positions, rot] float32,
    rot, NeoX-style), for vLLM's cache-based rotary embeddings (`RotaryEmbedding` and the subclasses
    that only change how the cache is made, such as Llama 3's); None for any other kind (its own
    forward then runs)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    emb = attention_module.rotary_emb
    own = ("forward_native", "forward_static", "forward", "forward_cpu")
    if not isinstance(emb, RotaryEmbedding) or any(
        getattr(type(emb), f) is not getattr(RotaryEmbedding, f) for f in own
    ):
        return None
    table = emb.cos_sin_cache.detach().to(torch.float32).contiguous().clone()
    return table, int(emb.rotary_dim), bool(emb.is_neox_style)


def check_engine(vllm_config) -> None:
    """Refuse what the plugin cannot honour, in one line each."""
    cache = vllm_config.cache_config
    archs = tuple(vllm_config.model_config.architectures or ())
    if not set(archs) & set(ARCHITECTURES):
        raise UnsupportedVllmError(
            f"infinigen's vLLM plugin serves {', '.join(ARCHITECTURES)}; this model is {', '.join(archs) or 'unknown'}"
        )
    if cache.enable_prefix_caching:
        raise UnsupportedVllmError(
            "infinigen's vLLM plugin needs prefix caching off: pass --no-enable-prefix-caching "
            "(LLM(..., enable_prefix_caching=False))"
        )
    if vllm_config.speculative_config is not None:
        raise UnsupportedVllmError("infinigen's vLLM plugin does not run with speculative decoding")
    if not vllm_config.model_config.enforce_eager:
        raise UnsupportedVllmError("infinigen's vLLM plugin runs in eager mode: pass --enforce-eager")
