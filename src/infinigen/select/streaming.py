"""`streaming`: attention sinks plus a recent window (StreamingLLM, Xiao et al., ICLR 2024):
the first `sinks` real positions and the most recent ones, `budget` positions in all."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinigen.select.base import SELECTING_BUDGET, PolicySpec, SelectionBudget, Selector
from infinigen.speculate import Selection, budget_counts, selection_from_mask
from infinigen.validation import at_least, knob


@dataclass(frozen=True)
class StreamingKnobs(SelectionBudget):
    sinks: int = knob(4, "streaming: attention-sink positions kept at the start", at_least(0), advanced=True)


def sinks_and_recent(valid: torch.Tensor, count: torch.Tensor, sinks: int) -> torch.Tensor:
    """Mask [B, Hkv, T]: per row, the first min(sinks, count) valid positions and the last
    count - that valid positions. valid: [B, Hkv, T]; count: [B, Hkv]."""
    context = valid.sum(-1)
    rank = valid.long().cumsum(-1) - 1  # rank among valid positions
    n_sink = count.clamp(max=sinks)
    n_recent = count - n_sink
    return valid & ((rank < n_sink[..., None]) | (rank >= (context - n_recent)[..., None]))


class StreamingSelector(Selector):
    name = "streaming"
    Knobs = StreamingKnobs
    policy = PolicySpec("offload", "streaming", default_budget=SELECTING_BUDGET, summary="attention sinks plus recent")

    def select(self, state, layer_idx, query, past, valid) -> Selection:
        count = budget_counts(valid.sum(-1), self.knobs.budget, self.knobs.budget_tokens)
        return selection_from_mask(sinks_and_recent(valid, count, self.knobs.sinks))
