"""`h2o`: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023). Each KV head keeps `budget`
positions: the most recent `recent_ratio` of them and, for the rest, those with the largest
attention accumulated over every step so far (the prefill's queries included). A position
dropped once is never attended again — the cache it models has evicted it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infinigen.select.base import SELECTING_BUDGET, PolicySpec, SelectionBudget, Selector
from infinigen.speculate import Selection, budget_counts, group_sum, selection_from_mask
from infinigen.validation import fraction, knob


@dataclass(frozen=True)
class H2OKnobs(SelectionBudget):
    recent_ratio: float = knob(
        0.5, "h2o: share of the budget kept as the most recent positions", fraction(False), advanced=True
    )


@dataclass
class HeavyHitters:
    acc: torch.Tensor | None = None  # [B, Hkv, T] accumulated attention (summed over the group)
    kept: torch.Tensor | None = None  # [B, Hkv, T] not evicted yet


def keep_heavy_and_recent(
    kept: torch.Tensor, acc: torch.Tensor, count: torch.Tensor, recent_ratio: float
) -> torch.Tensor:
    """Of the `kept` positions [B, Hkv, T], keep `count` [B, Hkv] per row: the
    floor(recent_ratio * count) most recent, then the largest `acc` among the others (earlier
    position first on ties)."""
    b, hkv, t = kept.shape
    n_recent = torch.floor(count.to(torch.float64) * recent_ratio).to(torch.long)[..., None]
    from_end = kept.flip(-1).long().cumsum(-1).flip(-1) - 1  # 0 at the most recent kept position
    recent = kept & (from_end < n_recent)
    heavy_n = count - recent.sum(-1)  # [B, Hkv]
    cand = kept & ~recent
    m = acc.to(torch.float32).masked_fill(~cand, -math.inf)
    order = torch.argsort(m, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(t, device=kept.device).expand(b, hkv, t))
    heavy = cand & (rank < heavy_n[..., None])
    return recent | heavy


class H2OSelector(Selector):
    name = "h2o"
    Knobs = H2OKnobs
    policy = PolicySpec(
        "offload", "h2o", default_budget=SELECTING_BUDGET, summary="heavy hitters plus recent; evicted for good"
    )

    def state_bytes(self, layer: int, batch: int, positions: int, capacity: int, kv_dtype: torch.dtype) -> int:
        return batch * self.adapter.num_kv_heads * positions * 5  # float32 scores, bool kept

    def new_state(self, layer_idx) -> HeavyHitters:
        return HeavyHitters()

    def on_append(self, state: HeavyHitters, layer_idx, keys, valid) -> None:
        b, hkv, n, _ = keys.shape
        acc = torch.zeros(b, hkv, n, dtype=torch.float32, device=keys.device)
        kept = valid[:, None, :].expand(b, hkv, n).to(keys.device).clone()
        state.acc = acc if state.acc is None else torch.cat([state.acc, acc], -1)
        state.kept = kept if state.kept is None else torch.cat([state.kept, kept], -1)

    def on_prefill(self, state: HeavyHitters, layer_idx, weights) -> None:
        sums = weights.column_sums()
        state.acc[..., : sums.shape[-1]] += sums.to(torch.float32)

    def select(self, state: HeavyHitters, layer_idx, query, past, valid) -> Selection:
        count = budget_counts(valid.sum(-1), self.knobs.budget, self.knobs.budget_tokens)
        kept = state.kept[..., :past] & valid
        kept = keep_heavy_and_recent(kept, state.acc[..., :past], count, self.knobs.recent_ratio)
        state.kept[..., :past] = kept  # evicted for good
        return selection_from_mask(kept)

    def observe(self, state: HeavyHitters, layer_idx, selection, probs, self_prob) -> None:
        hkv = selection.indices.shape[1]
        p = group_sum(probs.to(torch.float32), hkv) * selection.valid
        state.acc.scatter_add_(-1, selection.indices, p)
        pos = state.acc.shape[-1] - 1  # the current token, appended before its attention
        state.acc[..., pos] += group_sum(self_prob.to(torch.float32), hkv)
