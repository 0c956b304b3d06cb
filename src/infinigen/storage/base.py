"""What every slow tier is: storage for one layer's full K and V, and the counters of what it moved.

A tier knows nothing about attention or selection policies. It is handed rows to store and asked
for rows back; every read is counted (bytes, rows, requests, seconds) so that benchmarks read
what moved instead of estimating it. Writes (the KV of new tokens) are not fetch traffic.

The public methods validate their arguments here, once, and then call the tier's `_append`,
`_gather_async` and `_read_all_async`, so that no tier can skip a shape or index check.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch


@dataclass
class TransferStats:
    """Counters of what crossed from the slow tiers of one cache to the compute.

    bytes:        bytes read, read amplification included (whole disk blocks, whole pages);
    useful_bytes: bytes of the rows asked for, so that amplification = bytes / useful_bytes;
    rows:         (position, KV head) rows delivered; requests: reads issued; seconds: time spent.
    """

    bytes: int = 0
    useful_bytes: int = 0
    rows: int = 0
    requests: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int, rows: int, seconds: float, useful_bytes: int | None = None) -> None:
        """Count one read (called from I/O threads too)."""
        with self._lock:
            self.bytes += nbytes
            self.useful_bytes += nbytes if useful_bytes is None else useful_bytes
            self.rows += rows
            self.requests += 1
            self.seconds += seconds

    @property
    def amplification(self) -> float | None:
        """Bytes read per byte asked for; None before anything was read."""
        return self.bytes / self.useful_bytes if self.useful_bytes else None

    def reset(self) -> None:
        with self._lock:
            self.bytes = self.useful_bytes = self.rows = self.requests = 0
            self.seconds = 0.0


class KVStorageError(OSError):
    """A tier cannot store or read back the KV (space, directory, I/O)."""


class KVCapacityError(ValueError):
    """More positions were appended than the tier was sized for."""


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

    # ------------------------------------------------------------------ public, validated
    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Store new positions: keys/values [B, Hkv, n, d]; `valid` [B, n] marks real tokens
        (False at padding; only a capped pool uses it: padding takes no slot there)."""
        want = (self.batch, self.kv_heads)
        if keys.dim() != 4 or tuple(keys.shape[:2]) != want or keys.shape[-1] != self.head_dim:
            raise ValueError(
                f"tier holds [{self.batch}, {self.kv_heads}, T, {self.head_dim}], got keys {tuple(keys.shape)}"
            )
        if values.shape != keys.shape:
            raise ValueError(f"values {tuple(values.shape)} do not match keys {tuple(keys.shape)}")
        if valid is not None and tuple(valid.shape) != (self.batch, keys.shape[2]):
            raise ValueError(f"valid must be [{self.batch}, {keys.shape[2]}], got {tuple(valid.shape)}")
        if keys.shape[2]:
            self._append(keys, values, valid)

    def gather_async(
        self, indices: torch.Tensor, valid: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> Future:
        """Rows `indices` [B, Hkv, n] where `valid`, delivered later as [B, Hkv, n, d] each (zeros
        where not valid). Only the valid rows move and are counted. `.result()` waits."""
        if (
            indices.dim() != 3
            or indices.shape != valid.shape
            or tuple(indices.shape[:2]) != (self.batch, self.kv_heads)
        ):
            raise ValueError(
                f"indices/valid must be [{self.batch}, {self.kv_heads}, n], got {tuple(indices.shape)} "
                f"and {tuple(valid.shape)}"
            )
        chosen = indices[valid]
        if chosen.numel():
            low, high = int(chosen.min()), int(chosen.max())
            if low < 0 or high >= self.length:
                bad = low if low < 0 else high
                raise IndexError(f"selected position {bad} but the tier holds {self.length}")
        return self._gather_async(indices, valid, device, dtype)

    def gather(self, indices, valid, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gather_async(indices, valid, device, dtype).result()

    def read_all_async(self, upto: int, device: torch.device, dtype: torch.dtype) -> Future:
        """Positions [0, upto) of every row, delivered later as [B, Hkv, upto, d] each; counted."""
        if not 0 <= upto <= self.length:
            raise IndexError(f"asked for {upto} positions but the tier holds {self.length}")
        return self._read_all_async(upto, device, dtype)

    def read_all(self, upto, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read_all_async(upto, device, dtype).result()

    @property
    def evictions(self) -> int:
        """Positions this tier has forgotten for good (only a capped pool evicts)."""
        return 0

    def present(self, upto: int) -> torch.Tensor | None:
        """[B, Hkv, upto] bool of the positions still stored, or None when every one is (only a
        capped pool forgets positions)."""
        return None

    @abstractmethod
    def peek_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored, for evaluation only: not counted, never on the decode path."""

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing to release
        """Release what the tier holds (files, buffers)."""

    # ------------------------------------------------------------------ implementation
    @abstractmethod
    def _append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None) -> None: ...

    def _gather(self, indices, valid, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _read_all(self, upto, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _gather_async(self, indices, valid, device, dtype) -> Future:
        """Synchronous tiers gather now and hand back a finished Future."""
        return done_future(self._gather, indices, valid, device, dtype)

    def _read_all_async(self, upto, device, dtype) -> Future:
        return done_future(self._read_all, upto, device, dtype)


def done_future(fn, *args) -> Future:
    """`fn(*args)` run now, as a finished Future (an exception is delivered to whoever waits)."""
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:
        fut.set_exception(exc)
    return fut


def scatter_rows(
    flat: tuple[torch.Tensor, ...], rows_k: torch.Tensor, rows_v: torch.Tensor, shape, device, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [m, d] placed at the (b, h, slot) coordinates `flat` of zero tensors `shape` [B, Hkv, n, d]."""
    k = torch.zeros(shape, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    k[flat] = rows_k.to(device, dtype)
    v[flat] = rows_v.to(device, dtype)
    return k, v
