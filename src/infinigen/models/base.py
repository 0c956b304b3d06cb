"""What the method needs to know about a model family: where q/k, RoPE and the norm live, and
which layers attend over a sliding window.

An adapter never changes the model except through ``fold_skew`` (models without RoPE), and
only when `infinigen.attach` asks it to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from infinigen.errors import InfiniGenError

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


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
        self.max_positions: int = self._max_positions()
        self.layer_types: list[str] = self._layer_types()

    def _max_positions(self) -> int:
        """The context the model is meant for: `max_position_embeddings`, or `factor` times that
        under ``dynamic`` RoPE scaling, which exists to stretch the RoPE past it (the model
        recomputes its frequencies from the length it is run at)."""
        positions = int(getattr(self.config, "max_position_embeddings", 2048))
        rope = getattr(self.config, "rope_parameters", None) or getattr(self.config, "rope_scaling", None) or {}
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic":
            positions = int(positions * float(rope.get("factor", 1.0)))
        return positions

    def _layer_types(self) -> list[str]:
        """Each layer's attention: ``full_attention`` or ``sliding_attention`` (over the last
        `window` positions). As transformers reads a config: its `layer_types` when it has them
        (Gemma-3, Qwen2/3 with sliding layers), else every layer sliding when the config has a
        `sliding_window` (Mistral), else every layer full."""
        types = getattr(self.config, "layer_types", None)
        if types is None:
            sliding = getattr(self.config, "sliding_window", None) is not None
            types = [SLIDING if sliding else FULL] * self.num_layers
        types = list(types)[: self.num_layers]
        odd = sorted(set(types) - set(LAYER_TYPES))
        if odd:
            raise UnsupportedModelError(
                f"{self.config.model_type}: attention of type {odd[0]!r} is not supported; supported: full "
                "attention, sliding-window attention, or a mix of the two"
            )
        if SLIDING in types and not getattr(self.config, "sliding_window", None):
            raise UnsupportedModelError(f"{self.config.model_type}: sliding layers without a sliding_window size")
        return types

    # ------------------------------------------------------------------ layer kinds
    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends over a sliding window only (its KV stays bounded, with the compute)."""
        return self.layer_types[layer] == SLIDING

    def window(self, layer: int) -> int | None:
        """The sliding window of a local layer (positions a query sees, itself included); None for a full one."""
        return int(self.config.sliding_window) if self.is_local(layer) else None

    @property
    def global_layers(self) -> list[int]:
        """The layers with full attention: the only ones whose KV grows with the context."""
        return [i for i in range(self.num_layers) if not self.is_local(i)]

    # ------------------------------------------------------------------ attention internals
    def attention_modules(self) -> list[nn.Module]:
        """The attention module of every decoder layer, in order (found once: the speculation
        asks for one every layer of every step)."""
        if getattr(self, "_attention_modules", None) is None:
            self._attention_modules = self.find_attention_modules()
        return self._attention_modules

    @abstractmethod
    def find_attention_modules(self) -> list[nn.Module]:
        """Where this family keeps its attention modules."""

    def queries(self, layer: int, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Queries of `layer` for its normalized attention input x [B, T, D], as they enter
        the dot product (post-RoPE, with `layer`'s own rotary embedding, see `rope_for`) but
        without the attention scaling: [B, H, T, d]."""
        return self.query_heads(layer, self.attention_modules()[layer].q_proj(x), position_embeddings)

    @abstractmethod
    def query_heads(self, layer: int, projected: torch.Tensor, position_embeddings) -> torch.Tensor:
        """What `queries` does after the query projection: projected [B, T, H·d] (q_proj's
        output, or a fitted map's, see `infinigen.skew.query_map`) -> [B, H, T, d] as the dot
        product sees it (per-head norm and RoPE where the family has them)."""

    @abstractmethod
    def keys(self, layer: int, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Keys of `layer` as the cache stores them (post-RoPE): [B, Hkv, T, d]."""

    def values(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Values of `layer` for its normalized attention input x [B, T, D]: [B, Hkv, T, d]
        (a family with a norm on its values overrides this)."""
        return self._split_heads(self.attention_modules()[layer].v_proj(x), self.num_kv_heads)

    def rope_for(self, layer: int, source: int, position_embeddings, position_ids, x: torch.Tensor):
        """The rotary embedding (cos, sin) that `layer` uses for the positions whose embedding
        `source` was handed (`position_embeddings`, at `position_ids`): the same one for
        families whose layers share a RoPE; see Gemma-3 for one whose layers do not."""
        return position_embeddings

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
