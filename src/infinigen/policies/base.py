"""The one question every policy answers: which cached positions of layer i does this decode
step need? InfiniGen and every baseline implement it here, so the cache, the evaluator and the
benchmark drive them all through one code path and count their bytes with one counter.

A policy is stateless; what it remembers about a layer (partial keys, page bounds, accumulated
attention) lives in a per-layer state object it creates, so one policy object serves any number
of caches and the evaluator can replay the exact same calls.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from infinigen.config import InfiniGenConfig
from infinigen.models import ModelAdapter
from infinigen.speculate import Selection


class Policy:
    """Base class: fetch every row (the full-fetch offload baseline).

    Class attributes say how the cache must drive a policy:
      keeps_kv_on_compute: the whole KV stays with the compute (``dense``): nothing is fetched.
      selects:       layers ``>= dense_layers`` fetch a selection; otherwise every row.
      query_from:    which query `select` receives: ``"previous"`` — layer i's query computed from
                     layer i-1's input (InfiniGen's speculation, issued one layer ahead),
                     ``"own"`` — layer i's true query (issued at layer i: no overlap), or ``None``.
      observes:      `observe` wants the attention weights of every decode step (H2O).
      prefill_scores: `on_prefill_attention` wants the prefill's attention column sums (H2O).
    """

    name: ClassVar[str] = "full"
    keeps_kv_on_compute: ClassVar[bool] = False
    selects: ClassVar[bool] = False
    query_from: ClassVar[str | None] = None
    observes: ClassVar[bool] = False
    prefill_scores: ClassVar[bool] = False

    def __init__(self, config: InfiniGenConfig, adapter: ModelAdapter, attachment=None) -> None:
        self.config = config
        self.adapter = adapter

    # -------------------------------------------------------------- storage
    def store(self, x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
        """What a fetched row holds after its round trip through the tier (the evaluator uses
        this to reproduce the tier exactly): the value in the storage dtype."""
        return x.to(kv_dtype).to(x.dtype)

    def row_bytes(self, head_dim: int, kv_dtype: torch.dtype) -> int:
        """Bytes one position of one KV head moves (K and V)."""
        return 2 * head_dim * torch.empty((), dtype=kv_dtype).element_size()

    def make_tier(self, batch: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype, stats, default):
        """The slow tier of a layer; `default()` builds the configured one."""
        return default()

    # -------------------------------------------------------------- per-layer state
    def new_state(self, layer_idx: int) -> Any:
        return None

    def on_append(self, state: Any, layer_idx: int, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """New positions of the layer: keys [B, Hkv, n, d] as computed; valid [B, n] (False at
        padding). Called before the step's attention, after the step's `select`."""

    def select(
        self, state: Any, layer_idx: int, query: torch.Tensor | None, past: int, valid: torch.Tensor
    ) -> Selection:
        """Positions of [0, past) the coming step attends, per (batch, KV head).

        query: [B, H, d] post-RoPE (see `query_from`) or None; valid: [B, past]."""
        raise NotImplementedError

    def on_prefill_attention(self, state: Any, layer_idx: int, column_sums: torch.Tensor) -> None:
        """Prefill attention weights summed over queries and the group's heads: [B, Hkv, T]."""

    def observe(
        self, state: Any, layer_idx: int, selection: Selection, probs: torch.Tensor, self_prob: torch.Tensor
    ) -> None:
        """The step's attention weights: probs [B, H, n] on the selection's slots, self_prob
        [B, H] on the current token."""

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name}


def group_sum(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, ...] summed over each GQA group -> [B, Hkv, ...]."""
    b, h = x.shape[:2]
    return x.reshape(b, kv_heads, h // kv_heads, *x.shape[2:]).sum(2)
