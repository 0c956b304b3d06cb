"""Slow tiers that hold a layer's full K and V; they know nothing about attention.

Every read out of a tier goes through `gather` or `read_all`, which count the bytes moved.
Writes (the KV of new tokens) are not counted as fetch traffic.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import Future

import torch

from infinigen.kv.stats import TransferStats


class KVTier(ABC):
    """Storage for one layer's keys and values, [B, Hkv, T, d] each, appended along T."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, stats: TransferStats) -> None:
        self.batch, self.kv_heads, self.head_dim, self.dtype = batch, kv_heads, head_dim, dtype
        self.stats = stats
        self.length = 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one position's K and V for one KV head."""
        return 2 * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def _check_append(self, keys: torch.Tensor) -> None:
        if keys.shape[:2] != (self.batch, self.kv_heads) or keys.shape[-1] != self.head_dim:
            raise ValueError(
                f"tier holds [{self.batch}, {self.kv_heads}, T, {self.head_dim}], got keys {tuple(keys.shape)}"
            )

    def _check_indices(self, indices: torch.Tensor) -> None:
        if indices.shape[-1] and int(indices.max()) >= self.length:
            raise IndexError(f"selected position {int(indices.max())} but the tier holds {self.length}")

    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new positions (keys/values [B, Hkv, T_new, d])."""

    @abstractmethod
    def gather(
        self, indices: torch.Tensor, valid: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `indices` [B, Hkv, n] where `valid`, as [B, Hkv, n, d] (zeros where not valid).
        Only the valid rows move and are counted."""

    @abstractmethod
    def read_all(self, upto: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, upto) of every row, as [B, Hkv, upto, d]; counted."""

    @abstractmethod
    def peek_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored, for evaluation only: not counted, never on the decode path."""

    def gather_async(self, indices, valid, device, dtype) -> Future:
        """`gather` issued now, waited on later. Synchronous tiers return a finished Future."""
        return _done(self.gather, indices, valid, device, dtype)

    def read_all_async(self, upto, device, dtype) -> Future:
        """`read_all` issued now, waited on later."""
        return _done(self.read_all, upto, device, dtype)

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing to release
        """Release what the tier holds (files, buffers)."""


def _done(fn, *args) -> Future:
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:  # delivered to whoever waits, as a real async tier would
        fut.set_exception(exc)
    return fut


class RamTier(KVTier):
    """Host RAM: the trivial slow tier (and the reference the others must match bit for bit)."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, stats: TransferStats) -> None:
        super().__init__(batch, kv_heads, head_dim, dtype, stats)
        self._k = torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype)
        self._v = torch.empty_like(self._k)

    def _grow(self, need: int) -> None:
        cap = self._k.shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 256)
        k = torch.empty(self.batch, self.kv_heads, new_cap, self.head_dim, dtype=self.dtype)
        v = torch.empty_like(k)
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._check_append(keys)
        n = keys.shape[2]
        self._grow(self.length + n)
        self._k[:, :, self.length : self.length + n] = keys.detach().to("cpu", self.dtype)
        self._v[:, :, self.length : self.length + n] = values.detach().to("cpu", self.dtype)
        self.length += n

    def gather(self, indices, valid, device, dtype):
        start = time.perf_counter()
        b, h, n = indices.shape
        self._check_indices(indices)
        flat = valid.nonzero(as_tuple=True)  # (b, h, slot) of the rows that move
        pos = indices[flat]
        k_rows = self._k[flat[0], flat[1], pos]
        v_rows = self._v[flat[0], flat[1], pos]
        k = torch.zeros(b, h, n, self.head_dim, dtype=dtype, device=device)
        v = torch.zeros_like(k)
        k[flat] = k_rows.to(device, dtype)
        v[flat] = v_rows.to(device, dtype)
        rows = int(pos.numel())
        self.stats.add(rows * self.row_bytes, rows, time.perf_counter() - start)
        return k, v

    def read_all(self, upto, device, dtype):
        start = time.perf_counter()
        k = self._k[:, :, :upto].to(device, dtype, copy=True)
        v = self._v[:, :, :upto].to(device, dtype, copy=True)
        rows = self.batch * self.kv_heads * upto
        self.stats.add(rows * self.row_bytes, rows, time.perf_counter() - start)
        return k, v

    def peek_all(self):
        return self._k[:, :, : self.length], self._v[:, :, : self.length]


TIERS = ("ram", "disk", "pinned")


class SlotRamTier(RamTier):
    """Host RAM with a fixed number of slots per (batch, KV head), written where a host pool
    says; `gather` takes slot indices. Used when the pool holds less than the whole context."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, stats: TransferStats, slots: int):
        super().__init__(batch, kv_heads, head_dim, dtype, stats)
        self._k = torch.zeros(batch, kv_heads, slots, head_dim, dtype=dtype)
        self._v = torch.zeros_like(self._k)
        self.length = slots

    def append(self, keys, values):
        raise RuntimeError("a slotted tier is written with write(slots, keys, values)")

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [B, Hkv, n, d] at `slots` [B, Hkv, n] (-1: not stored)."""
        where = (slots >= 0).nonzero(as_tuple=True)
        self._k[where[0], where[1], slots[where]] = keys[where].detach().to("cpu", self.dtype)
        self._v[where[0], where[1], slots[where]] = values[where].detach().to("cpu", self.dtype)

    def read_all(self, upto, device, dtype):
        raise RuntimeError("a capped host pool cannot return every position (some were evicted)")


def make_tier(
    name: str,
    batch: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    stats: TransferStats,
    capacity: int | None = None,
    directory=None,
    threads: int = 4,
    device=None,
    pools=None,
) -> KVTier:
    if name == "ram":
        return RamTier(batch, kv_heads, head_dim, dtype, stats)
    if name == "disk":
        from infinigen.kv.disk import DiskTier

        if capacity is None:
            raise ValueError("the disk tier needs a capacity (the model's context length)")
        return DiskTier(
            batch, kv_heads, head_dim, dtype, stats, capacity, directory=directory, threads=threads, pools=pools
        )
    if name == "pinned":
        from infinigen.kv.pinned import PinnedTier

        return PinnedTier(batch, kv_heads, head_dim, dtype, stats, device if device is not None else "cuda")
    raise ValueError(f"unknown KV tier {name!r}; available: {', '.join(TIERS)}")
