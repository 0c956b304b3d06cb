"""Speculation over units: each aligned unit of N positions summarized by the mean (and the
per-channel variance) of its partial keys, so that a step scores T / N units instead of T
positions.

A unit's attention mass under a query q is sum_t exp(q . k_t). With the unit's mean key m and the
deviations d_t = k_t - m, it is exp(q . m) * sum_t exp(q . d_t), and to second order in d,
log mass ~ log n + q . m + 1/2 sum_c q_c^2 var_c (the cross-channel covariances dropped). "mean"
keeps the first two terms, "moments" all three. Each unit keeps its summary [m, var, log n]
channel-major, so that a position's append costs O(c) and the estimate is one score against
2c + 1 channels with the query [q, q^2 / 2, 1], which the selection kernel computes, aggregates
and ranks as it does positions (`kernels.select`).
"""

from __future__ import annotations

import math

import torch

from infinigen.growing import GrowingTensor

UNIT_KEYS = ("positions", "mean", "moments")  # what the speculation scores: every position, or unit summaries


class UnitMoments:
    """Per (batch row, unit): the count of real positions [B, units]; per (batch row, KV head,
    unit): the summary [mean, variance, log count] of its partial keys, channel-major
    [B, Hkv, 2c + 1, units], float32. A unit still filling is updated from its summary (its sums
    are the mean and the second moment times the count), so nothing else is kept."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.length = 0
        self.count = GrowingTensor(dim=-1)  # [B, units]
        self.summary = GrowingTensor(dim=-1)  # [B, Hkv, 2c + 1, units]: mean, variance, log count

    @staticmethod
    def bytes_per_unit(kv_heads: int, channels: int) -> int:
        """What one unit of one batch row keeps: its summary for every KV head and its count."""
        return (kv_heads * (2 * channels + 1) + 1) * 4

    def append(self, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """Add positions: partial keys [B, Hkv, n, c] and which are real, [B, n]."""
        b, hkv, n, c = keys.shape
        first, last = self.length, self.length + n
        units = -(-last // self.block)
        have = 0 if self.count.data is None else self.count.data.shape[-1]
        if units > have:  # open the units these positions start
            grow = units - have
            self.count.append(torch.zeros(b, grow, dtype=torch.float32))
            self.summary.append(torch.zeros(b, hkv, 2 * c + 1, grow, dtype=torch.float32))
        lo = first // self.block
        old_n = self.count.data[:, lo:units].clone()  # [B, u]
        held = self.summary.data[..., lo:units]  # [B, Hkv, 2c + 1, u]
        mean, var = held[:, :, :c], held[:, :, c : 2 * c]
        sums = mean * old_n[:, None, None, :]
        squares = (var + mean * mean) * old_n[:, None, None, :]
        unit = torch.arange(first, last) // self.block - lo
        w = valid.to(torch.float32)
        k = (keys.to(torch.float32) * w[:, None, :, None]).transpose(-1, -2)  # [B, Hkv, c, n]
        sums.index_add_(-1, unit, k)
        squares.index_add_(-1, unit, k * keys.to(torch.float32).transpose(-1, -2))
        self.count.data[:, lo:units].index_add_(-1, unit, w)
        count = self.count.data[:, lo:units].clamp(min=1.0)[:, None, None, :]
        new_mean = sums / count
        held[:, :, :c] = new_mean
        held[:, :, c : 2 * c] = (squares / count - new_mean * new_mean).clamp(min=0.0)
        held[:, :, 2 * c] = count[:, :, 0].log()
        self.length = last

    @property
    def nbytes(self) -> int:
        return self.count.nbytes + self.summary.nbytes

    def units_held(self, length: int) -> tuple[int, torch.Tensor]:
        """(units, [B, units] whether each holds a real position) over the first `length` positions."""
        units = -(-length // self.block)
        return units, self.count.data[:, :units] > 0

    def query(self, query: torch.Tensor, scaling: float, how: str) -> torch.Tensor:
        """[B, H, 2c + 1]: the partial queries [B, H, c] as the summary is scored, [q, q^2 / 2, 1]
        (q scaled; the variance's part 0 for "mean")."""
        if how not in UNIT_KEYS[1:]:
            raise ValueError(f"unknown unit keys {how!r}; use one of {', '.join(UNIT_KEYS[1:])}")
        q = query.to(torch.float32) * scaling
        second = 0.5 * q * q if how == "moments" else torch.zeros_like(q)
        return torch.cat([q, second, torch.ones_like(q[..., :1])], -1)

    def scores(self, query: torch.Tensor, scaling: float, how: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query head's estimated log mass of each unit, [B, H, units] (-inf where a unit
        holds no real position), and which units hold one, [B, units]; query: partial queries
        [B, H, c]."""
        units, ok = self.units_held(self.length)
        summary = self.summary.data[..., :units]  # [B, Hkv, 2c + 1, U]
        b, h, _ = query.shape
        hkv = summary.shape[1]
        q = self.query(query, scaling, how).reshape(b, hkv, h // hkv, -1)
        s = torch.matmul(q, summary).masked_fill(~ok[:, None, None, :], -math.inf)  # [B, Hkv, G, U]
        return s.reshape(b, h, units), ok
