"""Speculation over units: each aligned unit of N positions summarized by the mean (and the
per-channel variance) of its partial keys, so that a step scores T / N units instead of T
positions.

A unit's attention mass under a query q is sum_t exp(q . k_t). With the unit's mean key m and the
deviations d_t = k_t - m, it is exp(q . m) * sum_t exp(q . d_t), and to second order in d,
log mass ~ log n + q . m + 1/2 sum_c q_c^2 var_c (the cross-channel covariances dropped). "mean"
keeps the first two terms, "moments" all three. The sums are kept per unit, so a position's
append costs O(c) and the scoring reads 2c (or c) numbers per unit.
"""

from __future__ import annotations

import math

import torch

from infinigen.growing import GrowingTensor

UNIT_KEYS = ("positions", "mean", "moments")  # what the speculation scores: every position, or unit summaries


class UnitMoments:
    """Per (batch row, KV head, unit): the count of valid positions, the sum and the sum of squares
    of their partial keys [B, Hkv, units, c], in float32, grown along the units."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.length = 0
        self.count = GrowingTensor(dim=-1)  # [B, units]
        self.sums = GrowingTensor(dim=2)  # [B, Hkv, units, c]
        self.squares = GrowingTensor(dim=2)

    def append(self, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """Add positions: partial keys [B, Hkv, n, c] and which are real, [B, n]."""
        b, hkv, n, c = keys.shape
        first, last = self.length, self.length + n
        units = -(-last // self.block)
        have = 0 if self.count.data is None else self.count.data.shape[-1]
        if units > have:  # open the units these positions start
            grow = units - have
            self.count.append(torch.zeros(b, grow, dtype=torch.float32))
            self.sums.append(torch.zeros(b, hkv, grow, c, dtype=torch.float32))
            self.squares.append(torch.zeros(b, hkv, grow, c, dtype=torch.float32))
        unit = torch.arange(first, last) // self.block
        w = valid.to(torch.float32)
        k = keys.to(torch.float32) * w[:, None, :, None]
        self.count.data.index_add_(-1, unit, w)
        self.sums.data.index_add_(2, unit, k)
        self.squares.data.index_add_(2, unit, k * keys.to(torch.float32))
        self.length = last

    @property
    def nbytes(self) -> int:
        return self.count.nbytes + self.sums.nbytes + self.squares.nbytes

    def scores(self, query: torch.Tensor, scaling: float, how: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query head's estimated log mass of each unit, [B, H, units], and which units hold a
        real position, [B, units]; query: partial queries [B, H, c]."""
        n = self.count.data  # [B, U]
        ok = n > 0
        safe = n.clamp(min=1.0)[:, None, :, None]
        mean = self.sums.data / safe  # [B, Hkv, U, c]
        b, h, c = query.shape
        hkv = mean.shape[1]
        q = query.to(torch.float32).reshape(b, hkv, h // hkv, c) * scaling
        s = torch.matmul(q, mean.transpose(-1, -2))  # [B, Hkv, G, U]
        if how == "moments":
            var = (self.squares.data / safe - mean * mean).clamp(min=0.0)
            s = s + 0.5 * torch.matmul(q * q, var.transpose(-1, -2))
        elif how != "mean":
            raise ValueError(f"unknown unit keys {how!r}; use one of {', '.join(UNIT_KEYS[1:])}")
        s = s + n.clamp(min=1.0).log()[:, None, None, :]
        s = s.masked_fill(~ok[:, None, None, :], -math.inf)
        return s.reshape(b, h, -1), ok
