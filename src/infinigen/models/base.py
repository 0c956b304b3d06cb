"""What the method needs to know about a model family: where q/k, RoPE and the norm live.

An adapter never changes the model except through ``fold_skew`` (models without RoPE), and
only when `infinigen.attach` asks it to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from infinigen.errors import InfiniGenError


class UnsupportedModelError(InfiniGenError, ValueError):
    """The model's architecture is not one InfiniGen knows how to drive."""


class ModelAdapter(ABC):
    """Per-family access to the attention internals of a decoder-only transformer."""

    family: str = ""
    has_rope: bool = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.num_layers: int = self.config.num_hidden_layers
        self.num_heads: int = self.config.num_attention_heads
        self.num_kv_heads: int = getattr(self.config, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.num_heads
        self.max_positions: int = getattr(self.config, "max_position_embeddings", 2048)
        self.sliding_window: int | None = getattr(self.config, "sliding_window", None)

    def attention_modules(self) -> list[nn.Module]:
        """The attention module of every decoder layer, in order (found once: the speculation
        asks for one every layer of every step)."""
        if getattr(self, "_attention_modules", None) is None:
            self._attention_modules = self.find_attention_modules()
        return self._attention_modules

    @abstractmethod
    def find_attention_modules(self) -> list[nn.Module]:
        """Where this family keeps its attention modules."""

    @abstractmethod
    def queries(self, layer: int, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Queries of `layer` for its normalized attention input x [B, T, D], as they enter
        the dot product (post-RoPE) but without the 1/sqrt(d) scaling: [B, H, T, d]."""

    @abstractmethod
    def keys(self, layer: int, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Keys of `layer` as the cache stores them (post-RoPE): [B, Hkv, T, d]."""

    def scaling(self, layer: int) -> float:
        return self.head_dim**-0.5

    def fold_skew(self, skews: dict[int, torch.Tensor]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Fold per-head orthogonal matrices into W_q/W_k (only for models without RoPE).
        Returns every changed parameter with a copy of its original value, so that the caller
        (attach, the only code that changes a model) can restore it bit for bit."""
        raise NotImplementedError(f"{self.family}: the skew is applied at run time, not folded")

    def _split_heads(self, y: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = y.shape
        return y.view(b, t, heads, self.head_dim).transpose(1, 2)
