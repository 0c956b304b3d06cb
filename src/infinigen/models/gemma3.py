"""Gemma-3 (text): hybrid sliding / global attention with a RoPE base of its own per layer type.

What differs from the Llama-like families, all of it read from the model, never re-derived:
  - five sliding-window layers (window 512 in the released models) per global layer
    (`layer_types`); the sliding ones are local (see `ModelAdapter.is_local`);
  - q/k RMS norms over each head before RoPE (`q_norm`, `k_norm`), as in Qwen3;
  - two rotary embeddings: base 10 000 for the sliding layers, 1 000 000 (with linear scaling
    in the larger models) for the global ones. A global layer is speculated from the input of
    the layer before it, usually a sliding one, which was handed the sliding embedding:
    `rope_for` computes the global one instead, with the model's own rotary module;
  - attention scaling `query_pre_attn_scalar ** -0.5`, read from each attention module;
  - attention-logit soft-capping: the released configs have none (transformers' Gemma-3
    attention applies it only in its eager path); a config that sets it is refused, because
    attention over selected rows does not model it. The final-logit soft-capping acts after
    the cache and changes nothing here.
"""

from __future__ import annotations

import torch

from infinigen.models.base import UnsupportedModelError
from infinigen.models.llama import LlamaLikeAdapter


class Gemma3Adapter(LlamaLikeAdapter):
    family = "gemma3"

    def __init__(self, model) -> None:
        super().__init__(model)
        if getattr(self.config, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError(
                "gemma3_text with attn_logit_softcapping is not supported: attention over the selected "
                "rows does not soft-cap its logits (the released Gemma-3 configs set none)"
            )

    def rope_for(self, layer: int, source: int, position_embeddings, position_ids, x: torch.Tensor):
        wanted = self.layer_types[layer]
        if wanted == self.layer_types[source]:
            return position_embeddings
        if position_ids is None:  # the model always passes them; a bare call of a layer may not
            raise ValueError(f"Gemma-3 layer {layer} needs position ids to compute its rotary embedding")
        return self.model.model.rotary_emb(x, position_ids, wanted)
