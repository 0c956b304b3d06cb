"""`oracle`: the true top-k of the attention at the same budget — per KV head, the positions
with the most attention mass summed over the group's query heads, which maximises the mean
recall over those heads. It reads every key to choose (uncounted): an upper bound for any
selector at a given fraction fetched, not a system. With units (`block_tokens`, `unit_heads`) it
keeps the units of most true mass: the bound of any selector choosing in those units."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from infinigen.growing import GrowingTensor
from infinigen.select.base import SELECTING_BUDGET, PolicySpec, Selector, UnitSelection
from infinigen.speculate import Selection, budget_counts, group_sum, select_blocks, selection_from_mask


@dataclass
class KeyCopy:
    """Every key of the layer as the tier returns them, [B, Hkv, T, d], grown in place."""

    buffer: GrowingTensor = field(default_factory=lambda: GrowingTensor(dim=-2))

    @property
    def keys(self) -> torch.Tensor | None:
        return self.buffer.data


def true_probs(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax over the valid cached positions: query [B, H, d], keys [B, Hkv, T, d],
    valid [B, Hkv, T] -> [B, H, T]."""
    b, h, d = query.shape
    hkv = keys.shape[1]
    q = query.to(torch.float32).reshape(b, hkv, h // hkv, d)
    s = torch.matmul(q, keys.to(torch.float32).transpose(-1, -2)) * scaling  # [B, Hkv, G, T]
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    return torch.softmax(s, -1).reshape(b, h, -1)


def top_mass(mass: torch.Tensor, valid: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mask [B, Hkv, T] of the `count` [B, Hkv] valid positions with the largest mass per row."""
    b, hkv, t = mass.shape
    m = mass.masked_fill(~valid, float("-inf"))
    order = torch.argsort(m, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(t, device=m.device).expand(b, hkv, t))
    return (rank < count[..., None]) & valid


class OracleSelector(Selector):
    name = "oracle"
    Knobs = UnitSelection  # the budget, and the unit it chooses in
    policy = PolicySpec(
        "offload",
        "oracle",
        default_budget=SELECTING_BUDGET,
        summary="true top attention mass (upper bound)",
        bound=True,  # it reads every key to choose
    )
    query_from = "own"

    def state_bytes(self, layer: int, batch: int, positions: int, capacity: int, kv_dtype: torch.dtype) -> int:
        return batch * self.adapter.num_kv_heads * capacity * self.adapter.head_dim * 4  # the keys, as computed (fp32)

    def new_state(self, layer_idx):
        return KeyCopy()

    def __init__(self, knobs, adapter, kv_dtype: torch.dtype | None = None) -> None:
        """kv_dtype: the storage dtype, so that the oracle ranks the keys attention will see."""
        super().__init__(knobs, adapter)
        self.kv_dtype = kv_dtype

    def on_append(self, state: KeyCopy, layer_idx, keys, valid) -> None:
        stored = keys if self.kv_dtype is None else keys.to(self.kv_dtype).to(keys.dtype)
        state.buffer.append(stored)

    def select(self, state: KeyCopy, layer_idx, query, past, valid) -> Selection:
        probs = true_probs(query, state.keys[:, :, :past], valid, self.adapter.scaling(layer_idx))
        mass = group_sum(probs, self.adapter.num_kv_heads)
        k = self.knobs
        if k.units > 1 or k.unit_heads == "shared":  # units ranked by their true mass: the units' bound
            log_mass = mass.clamp(min=1e-38).log().masked_fill(~valid, -math.inf)
            shared = k.unit_heads == "shared"
            return select_blocks(log_mass, valid, k.units, math.inf, k.budget, k.budget_tokens, 1, "mass", shared)
        count = budget_counts(valid.sum(-1), k.budget, k.budget_tokens)
        return selection_from_mask(top_mass(mass, valid, count))
