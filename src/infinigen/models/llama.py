"""Llama-like families (Llama, Qwen2, Qwen3, Mistral): pre-norm, GQA, RoPE between projection and dot.

The rotary embedding comes from the model itself (the cos/sin its layers are handed), so RoPE
scaling of any type (Llama-3's ``llama3``, ``yarn``, ``dynamic``, ...) is whatever the model
computes; Qwen3's per-head q/k RMS norms sit between projection and RoPE; Qwen2's q/k biases are
in the projections."""

from __future__ import annotations

import torch
from torch import nn

from infinigen.models.base import ModelAdapter


class LlamaLikeAdapter(ModelAdapter):
    family = "llama"
    has_rope = True

    def find_attention_modules(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.model.model.layers]

    def _rope(self, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        """The model's rotary embedding of x [B, heads, T, d] (as `apply_rotary_pos_emb` does
        for q, without rotating a k alongside)."""
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def query_heads(self, layer: int, projected: torch.Tensor, position_embeddings) -> torch.Tensor:
        attn = self.attention_modules()[layer]
        q = self._split_heads(projected, self.num_heads)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q.transpose(1, 2)).transpose(1, 2)
        return self._rope(q, position_embeddings)

    def keys(self, layer: int, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        attn = self.attention_modules()[layer]
        k = self._split_heads(attn.k_proj(x), self.num_kv_heads)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k.transpose(1, 2)).transpose(1, 2)
        return self._rope(k, position_embeddings)

    def scaling(self, layer: int) -> float:
        return float(self.attention_modules()[layer].scaling)
