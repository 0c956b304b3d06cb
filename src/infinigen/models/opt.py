"""OPT: learned positions, no RoPE, so the skew folds into W_q/W_k and their biases."""

from __future__ import annotations

import torch
from torch import nn

from infinigen.models.base import ModelAdapter, UnsupportedModelError


class OPTAdapter(ModelAdapter):
    family = "opt"
    has_rope = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if not getattr(self.config, "do_layer_norm_before", True):
            raise UnsupportedModelError(
                "OPT with post-attention layer norm (opt-350m) is not supported: the attention input "
                "of the next layer is not the normalized residual stream"
            )

    def find_attention_modules(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.model.model.decoder.layers]

    def query_heads(self, layer: int, projected: torch.Tensor, position_embeddings) -> torch.Tensor:
        return self._split_heads(projected, self.num_heads)

    def keys(self, layer: int, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        attn = self.attention_modules()[layer]
        return self._split_heads(attn.k_proj(x), self.num_kv_heads)

    def scaling(self, layer: int) -> float:
        return float(self.attention_modules()[layer].scaling)

    @torch.no_grad()
    def fold_skew(self, skews: dict[int, torch.Tensor]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        mods = self.attention_modules()
        d = self.head_dim
        originals = []
        for layer, a in skews.items():
            a = a.to(torch.float64)
            for proj in (mods[layer].q_proj, mods[layer].k_proj):
                originals.append((proj.weight, proj.weight.detach().clone()))
                w = proj.weight.data.to(torch.float64).view(self.num_heads, d, -1)  # [H, d, in]
                # New per-head output is y_h @ A: rows of W_h mix by A^T.
                w = torch.einsum("hde,hdi->hei", a, w)
                proj.weight.data.copy_(w.reshape(proj.weight.shape).to(proj.weight.dtype))
                if proj.bias is not None:
                    originals.append((proj.bias, proj.bias.detach().clone()))
                    bias = proj.bias.data.to(torch.float64).view(self.num_heads, d)
                    bias = torch.einsum("hd,hde->he", bias, a)
                    proj.bias.data.copy_(bias.reshape(-1).to(proj.bias.dtype))
        return originals
