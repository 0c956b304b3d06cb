"""What every slow tier is: storage for one layer's full K and V, and the counters of what it moved.

A tier knows nothing about attention or selection policies. It is handed rows to store and asked
for rows back; every read is counted (bytes, rows, requests, seconds) so that benchmarks read
what moved instead of estimating it. Writes (the KV of new tokens) are not fetch traffic.

The public methods validate their arguments here, once, and then call the tier's `_append`,
`_gather_async` and `_read_range_async`, so that no tier can skip a shape or index check.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from infinigen.errors import InfiniGenError
from infinigen.growing import grown_size


@dataclass
class TransferStats:
    """Counters of what crossed from the slow tiers of one cache to the compute.

    bytes:        bytes read from the tier's medium, read amplification included (whole disk
                  blocks), plus `cached_bytes`: every byte that reached the compute's buffers;
    cached_bytes: the part of `bytes` served from RAM in front of a slower medium (the disk
                  tier's unwritten tail blocks), exact, without amplification;
    useful_bytes: bytes of the rows asked for that came from the medium, so that
                  amplification = (bytes - cached_bytes) / useful_bytes;
    rows:         (position, KV head) rows delivered; requests: transfers issued; reads: read
                  requests sent to the medium (disk); seconds: time spent.
    """

    bytes: int = 0
    cached_bytes: int = 0
    useful_bytes: int = 0
    rows: int = 0
    requests: int = 0
    reads: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(
        self,
        nbytes: int,
        rows: int,
        seconds: float,
        useful_bytes: int | None = None,
        cached_bytes: int = 0,
        reads: int = 0,
    ) -> None:
        """Count one transfer (called from I/O threads too): `nbytes` from the medium, `cached_bytes` from RAM."""
        with self._lock:
            self.bytes += nbytes + cached_bytes
            self.cached_bytes += cached_bytes
            self.useful_bytes += nbytes if useful_bytes is None else useful_bytes
            self.rows += rows
            self.requests += 1
            self.reads += reads
            self.seconds += seconds

    @property
    def amplification(self) -> float | None:
        """Bytes read from the medium per byte asked for from it; None before anything was read."""
        return (self.bytes - self.cached_bytes) / self.useful_bytes if self.useful_bytes else None

    def reset(self) -> None:
        with self._lock:
            self.bytes = self.cached_bytes = self.useful_bytes = self.rows = self.requests = self.reads = 0
            self.seconds = 0.0


class KVStorageError(InfiniGenError, OSError):
    """A tier cannot store or read back the KV (space, directory, I/O). Made as
    ``KVStorageError(errno, sentence)``: `errno` says what failed, the sentence is the message."""

    def __str__(self) -> str:
        return self.strerror if self.strerror is not None else super().__str__()


class KVCapacityError(InfiniGenError, ValueError):
    """More positions were appended than the tier was sized for."""


class KVInputError(InfiniGenError, ValueError):
    """Rows, indices or buffers handed to a tier that do not fit it (shape, dtype)."""


class KVIndexError(InfiniGenError, IndexError):
    """A position asked for that the tier does not hold."""


_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)


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

    def rows_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype the compute's transfer buffers hold this tier's rows in (`rows_dtype`)."""
        return rows_dtype("native", self.dtype, compute_dtype)

    # ------------------------------------------------------------------ public, validated
    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Store new positions: keys/values [B, Hkv, n, d]; `valid` [B, n] marks real tokens
        (False at padding; only a capped pool uses it: padding takes no slot there)."""
        want = (self.batch, self.kv_heads)
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise KVInputError(f"{name} must be a floating-point tensor, got {_describe(t)}")
        if keys.dim() != 4 or tuple(keys.shape[:2]) != want or keys.shape[-1] != self.head_dim:
            raise KVInputError(
                f"tier holds [{self.batch}, {self.kv_heads}, T, {self.head_dim}], got keys {tuple(keys.shape)}"
            )
        if values.shape != keys.shape:
            raise KVInputError(f"values {tuple(values.shape)} do not match keys {tuple(keys.shape)}")
        if valid is not None and (
            not isinstance(valid, torch.Tensor)
            or valid.dtype != torch.bool
            or tuple(valid.shape) != (self.batch, keys.shape[2])
        ):
            raise KVInputError(f"valid must be a bool tensor [{self.batch}, {keys.shape[2]}], got {_describe(valid)}")
        if keys.shape[2]:
            self._append(keys, values, valid)

    def gather_async(
        self,
        indices: torch.Tensor,
        valid: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Future:
        """Rows `indices` [B, Hkv, n] where `valid`, delivered later as [B, Hkv, n, d] each. Only
        the valid rows move and are counted. `.result()` waits.

        out: (k, v) buffers [B, Hkv, >= n, d] of `dtype` on `device` that the rows are written
        into, converted once where they land (the result is a view of their first n slots; slots
        not valid keep what they held); default: new tensors, zeros where not valid."""
        if not isinstance(indices, torch.Tensor) or indices.dtype not in _INDEX_DTYPES:
            raise KVInputError(f"indices must be an integer tensor (int16, int32, int64), got {_describe(indices)}")
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
            raise KVInputError(f"valid must be a bool tensor, got {_describe(valid)}")
        if (
            indices.dim() != 3
            or indices.shape != valid.shape
            or tuple(indices.shape[:2]) != (self.batch, self.kv_heads)
        ):
            raise KVInputError(
                f"indices/valid must be [{self.batch}, {self.kv_heads}, n], got {tuple(indices.shape)} "
                f"and {tuple(valid.shape)}"
            )
        chosen = indices[valid]
        if chosen.numel():
            low, high = int(chosen.min()), int(chosen.max())
            if low < 0 or high >= self.length:
                bad = low if low < 0 else high
                raise KVIndexError(f"selected position {bad} but the tier holds {self.length}")
        _check_dtype(dtype)
        self._check_out(out, indices.shape[2], device, dtype)
        indices = indices.long()  # what every tier indexes with (no copy when it already is)
        return self._gather_async(indices, valid, device, dtype, out)

    def gather(self, indices, valid, device, dtype, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gather_async(indices, valid, device, dtype, out).result()

    def read_all_async(
        self, upto: int, device: torch.device, dtype: torch.dtype, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> Future:
        """Positions [0, upto) of every row, delivered later as [B, Hkv, upto, d] each; counted.
        out: buffers [B, Hkv, >= upto, d] to write them into (see `gather_async`)."""
        return self.read_range_async(0, upto, device, dtype, out)

    def read_all(self, upto, device, dtype, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read_all_async(upto, device, dtype, out).result()

    def read_range_async(
        self,
        start: int,
        stop: int,
        device: torch.device,
        dtype: torch.dtype,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Future:
        """Positions [start, stop) of every row, delivered later as [B, Hkv, stop - start, d]
        each; counted. The medium's sequential read (a layer read in chunks reads its chunks so),
        where a gather of the same rows would pay for scattered ones. out: as `read_all_async`."""
        for name, x in (("start", start), ("stop", stop)):
            if isinstance(x, bool) or not hasattr(x, "__index__"):
                raise KVInputError(f"{name} must be an integer number of positions, got {_describe(x)}")
        start, stop = start.__index__(), stop.__index__()
        if not 0 <= start <= stop <= self.length:
            raise KVIndexError(f"asked for positions [{start}, {stop}) but the tier holds {self.length}")
        _check_dtype(dtype)
        self._check_out(out, stop - start, device, dtype)
        return self._read_range_async(start, stop, device, dtype, out)

    def _check_out(self, out, n: int, device, dtype) -> None:
        if out is None:
            return
        k, v = out
        want = (self.batch, self.kv_heads)
        for t in (k, v):
            if t.dim() != 4 or tuple(t.shape[:2]) != want or t.shape[2] < n or t.shape[3] != self.head_dim:
                raise KVInputError(
                    f"out buffers must be [{self.batch}, {self.kv_heads}, >= {n}, {self.head_dim}], got {tuple(t.shape)}"
                )
            if t.dtype != dtype or t.device != torch.device(device):
                raise KVInputError(f"out buffers must be {dtype} on {device}, got {t.dtype} on {t.device}")

    @property
    def evictions(self) -> int:
        """Positions this tier has forgotten for good (only a capped pool evicts)."""
        return 0

    # ------------------------------------------------------------------ memory (infinigen.memory)
    def stored_bytes(self) -> int:
        """Bytes this layer's KV takes in the tier's medium (spare capacity included)."""
        return 0

    def beside_compute(self) -> dict[str, int]:
        """Bytes the tier keeps in the compute's memory for the medium's sake, by part (the
        parts of `infinigen.memory.PARTS`); none by default."""
        return {}

    def in_place(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored rows (k, v) [B, Hkv, capacity, d] where a CPU compute reads them by position
        as they lie, or None where a read must move them (a disk, another device, a pool's slots,
        a packed format)."""
        return None

    def count_in_place(self, rows: int) -> None:
        """Count `rows` rows read in place by the compute, as a gather of them counts (no transfer time)."""
        self.stats.add(rows * self.row_bytes, rows, 0.0)

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

    def _gather(self, indices, valid, device, dtype, out) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _read_range(self, start, stop, device, dtype, out) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _gather_async(self, indices, valid, device, dtype, out) -> Future:
        """Synchronous tiers gather now and hand back a finished Future."""
        return done_future(self._gather, indices, valid, device, dtype, out)

    def _read_range_async(self, start, stop, device, dtype, out) -> Future:
        return done_future(self._read_range, start, stop, device, dtype, out)


def _describe(x) -> str:
    """A value as an error message shows it: a tensor's dtype and shape, else its type."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {tuple(x.shape)}"
    return type(x).__name__


def rows_dtype(fmt: str, kv_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a step's rows are read back into on the compute's side. Native rows: the storage
    dtype, which holds them exactly (half the bytes of fp32 for 16-bit KV), unless the compute's is
    narrower. int4 rows: the compute's, since the codes are dequantized in fp32 and cast once (a
    narrower buffer would round them a second time)."""
    if fmt == "int4":
        return compute_dtype
    return kv_dtype if kv_dtype.itemsize <= compute_dtype.itemsize else compute_dtype


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise KVInputError(f"rows are delivered as a floating-point dtype, got {dtype!r}")


def done_future(fn, *args) -> Future:
    """`fn(*args)` run now, as a finished Future (an exception is delivered to whoever waits)."""
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:
        fut.set_exception(exc)
    return fut


def scatter_rows(
    flat: tuple[torch.Tensor, ...], rows_k: torch.Tensor, rows_v: torch.Tensor, shape, device, dtype, out=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [m, d] placed at the (b, h, slot) coordinates `flat` of `out` (views of its first n
    slots) or of zero tensors `shape` [B, Hkv, n, d]; converted to `dtype` once, here."""
    b, h, n, d = shape
    if out is None:
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros_like(k)
        k[flat] = rows_k.to(device, dtype)
        v[flat] = rows_v.to(device, dtype)
        return k, v
    k, v = prefix_views(out, n)
    if out[0].is_contiguous() and out[1].is_contiguous():
        capacity = out[0].shape[2]  # one linear index per row: a row copy, not a 3-index scatter
        dest = ((flat[0] * h + flat[1]) * capacity + flat[2]).to(device)
        out[0].view(-1, d).index_copy_(0, dest, rows_k.to(device, dtype))
        out[1].view(-1, d).index_copy_(0, dest, rows_v.to(device, dtype))
    else:
        k[flat] = rows_k.to(device, dtype)
        v[flat] = rows_v.to(device, dtype)
    return k, v


def grown_rows(
    pair: tuple[torch.Tensor, torch.Tensor], length: int, need: int, empty
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, Hkv, capacity, d] with space for `need` positions by the one growth rule
    (`growing.grown_size`), the first `length` kept; `pair` itself when it has the space.
    `empty(shape)` allocates a tensor of the tier's kind (plain or page-locked memory)."""
    k, v = pair
    if need <= k.shape[2]:
        return pair
    shape = (*k.shape[:2], grown_size(k.shape[2], need), k.shape[3])
    grown = empty(shape), empty(shape)
    for new, old in zip(grown, pair):
        new[:, :, :length] = old[:, :, :length]
    return grown


def prefix_views(out: tuple[torch.Tensor, torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n slots of a pair of [B, Hkv, >= n, d] buffers."""
    return out[0][:, :, :n], out[1][:, :, :n]


def copy_prefix(k_src: torch.Tensor, v_src: torch.Tensor, device, dtype, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv, n, d] rows as `dtype` on `device`: copied into `out`'s first n slots, or new tensors."""
    if out is None:
        return k_src.to(device, dtype, copy=True), v_src.to(device, dtype, copy=True)
    k, v = prefix_views(out, k_src.shape[2])
    k.copy_(k_src)
    v.copy_(v_src)
    return k, v
