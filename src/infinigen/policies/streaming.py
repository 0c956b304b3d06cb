"""`streaming`: attention sinks plus a recent window (StreamingLLM, Xiao et al., ICLR 2024):
the first `sinks` real positions and the most recent ones, `budget` positions in all."""

from __future__ import annotations

import torch

from infinigen.policies.base import Policy
from infinigen.speculate import Selection, budget_counts, selection_from_mask


def sinks_and_recent(valid: torch.Tensor, kv_heads: int, count: torch.Tensor, sinks: int) -> torch.Tensor:
    """Mask [B, Hkv, T]: per batch row, the first min(sinks, count) real positions and the last
    count - that real positions. valid: [B, T]; count: [B]."""
    context = valid.sum(-1)
    rank = valid.long().cumsum(-1) - 1  # rank among real positions
    n_sink = count.clamp(max=sinks)
    n_recent = count - n_sink
    keep = valid & ((rank < n_sink[:, None]) | (rank >= (context - n_recent)[:, None]))
    return keep[:, None, :].expand(-1, kv_heads, -1)


class StreamingPolicy(Policy):
    name = "streaming"
    selects = True

    def select(self, state, layer_idx, query, past, valid) -> Selection:
        context = valid.sum(-1)
        count = budget_counts(context, self.config.budget, self.config.budget_tokens)
        keep = sinks_and_recent(valid, self.adapter.num_kv_heads, count, self.config.sinks)
        return selection_from_mask(keep, context)

    def describe(self):
        return {"policy": self.name, "budget": self.config.budget, "sinks": self.config.sinks}
