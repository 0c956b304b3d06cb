"""`quest`: query-aware page selection (Tang et al., ICML 2024). Keys are grouped in pages of
`page_tokens` positions; each page keeps the channel-wise min and max of its keys on the
compute side, and the true query ranks pages by the upper bound Σ_c max(q_c·max_c, q_c·min_c)
of any of its dot products. The top pages within `budget` are fetched (the last chosen page
may overshoot the budget by less than a page). A GQA group ranks a page by its best head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infinigen.select.base import SELECTING_BUDGET, PolicySpec, SelectionBudget, Selector
from infinigen.speculate import Selection, budget_counts, selection_from_mask
from infinigen.validation import at_least, knob


@dataclass(frozen=True)
class QuestKnobs(SelectionBudget):
    page_tokens: int = knob(16, "quest: positions per page", at_least(1), advanced=True)


@dataclass
class PageBounds:
    low: torch.Tensor | None = None  # [B, Hkv, P, d] channel-wise min of the page's real keys
    high: torch.Tensor | None = None  # [B, Hkv, P, d] max
    real: torch.Tensor | None = None  # [B, P] real (non-padding) positions in the page
    length: int = 0


def page_upper_bounds(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """query [B, H, d]; bounds [B, Hkv, P, d] -> [B, Hkv, P]: the largest bound over the group's
    heads, -inf for pages without a real position."""
    b, h, d = query.shape
    hkv = low.shape[1]
    q = query.to(torch.float32).reshape(b, hkv, h // hkv, 1, d)
    lo, hi = low[:, :, None].to(torch.float32), high[:, :, None].to(torch.float32)
    ub = torch.maximum(q * hi, q * lo).sum(-1).amax(2)  # [B, Hkv, P]
    return ub.masked_fill((real == 0)[:, None, :], -math.inf)


class QuestSelector(Selector):
    name = "quest"
    Knobs = QuestKnobs
    policy = PolicySpec(
        "offload", "quest", default_budget=SELECTING_BUDGET, summary="pages ranked by a query-aware bound"
    )
    query_from = "own"

    def max_rows(self, layer: int, positions: int) -> int:
        page = self.knobs.page_tokens
        return (-(-super().max_rows(layer, positions) // page) + 1) * page  # whole pages, a partial one included

    def state_bytes(self, layer: int, batch: int, positions: int, capacity: int, kv_dtype: torch.dtype) -> int:
        pages = -(-positions // self.knobs.page_tokens)
        bounds = 2 * batch * self.adapter.num_kv_heads * pages * self.adapter.head_dim * 4  # float32 low, high
        return bounds + batch * pages * 8  # + real positions per page (int64)

    def new_state(self, layer_idx) -> PageBounds:
        return PageBounds()

    def on_append(self, state: PageBounds, layer_idx, keys, valid) -> None:
        b, hkv, n, d = keys.shape
        page = self.knobs.page_tokens
        start, end = state.length, state.length + n
        pages = -(-end // page)
        have = 0 if state.low is None else state.low.shape[2]
        if pages > have:
            grow = pages - have
            lo = torch.full((b, hkv, grow, d), math.inf, dtype=torch.float32, device=keys.device)
            hi = torch.full_like(lo, -math.inf)
            real = torch.zeros(b, grow, dtype=torch.long, device=keys.device)
            if state.low is None:
                state.low, state.high, state.real = lo, hi, real
            else:
                state.low = torch.cat([state.low, lo], 2)
                state.high = torch.cat([state.high, hi], 2)
                state.real = torch.cat([state.real, real], 1)
        idx = (torch.arange(start, end, device=keys.device) // page)[None, None, :, None].expand(b, hkv, n, d)
        pad = ~valid.to(keys.device)[:, None, :, None]
        k = keys.to(torch.float32)
        state.low.scatter_reduce_(2, idx, k.masked_fill(pad, math.inf), "amin")
        state.high.scatter_reduce_(2, idx, k.masked_fill(pad, -math.inf), "amax")
        state.real.scatter_add_(1, idx[:, 0, :, 0], valid.to(keys.device).long())
        state.length = end

    def select(self, state: PageBounds, layer_idx, query, past, valid) -> Selection:
        page = self.knobs.page_tokens
        p = -(-past // page)
        ub = page_upper_bounds(query, state.low[:, :, :p], state.high[:, :, :p], state.real[:, :p])
        count = budget_counts(valid.sum(-1), self.knobs.budget, self.knobs.budget_tokens)
        n_pages = -(-count // page)  # [B, Hkv]
        b, hkv, _ = ub.shape
        order = torch.argsort(ub, dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(p, device=ub.device).expand(b, hkv, p))
        chosen = (rank < n_pages[..., None]) & torch.isfinite(ub)
        keep = chosen.repeat_interleave(page, dim=-1)[..., :past] & valid
        return selection_from_mask(keep)
