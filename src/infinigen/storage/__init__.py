"""Where KV rows live: the slow tiers, their storage formats, and the one factory that builds them.

Tiers (`ram`, `disk`, `pinned`) and formats (`native`: the storage dtype; `int4`: FlexGen's
group-wise 4-bit) know nothing about attention or selection policies: they store rows and hand
back the rows asked for, counting every byte. `Storage` is the only code that builds a tier; it
also owns what the tiers of one cache share (counters, I/O threads, the disk space reservation).
"""

from __future__ import annotations

import errno
import os
import weakref

import torch

from infinigen.storage.base import KVCapacityError, KVStorageError, KVTier, TransferStats, rows_dtype
from infinigen.storage.copyengine import COPY_ENGINES, CopyEngine, CudaCopyEngine, ThreadCopyEngine, new_copy_engine
from infinigen.storage.disk import DiskTier, IOThreads, check_space, reserved_bytes
from infinigen.storage.disk_file import kv_directory
from infinigen.storage.int4 import GROUP, Int4RamTier, fake_quantize_int4, int4_row_bytes
from infinigen.storage.layout import block_size, record_bytes
from infinigen.storage.pinned import PinnedTier
from infinigen.storage.pool import EVICTIONS, PooledTier, capacity_slots
from infinigen.storage.ram import RamTier

TIERS = ("ram", "disk", "pinned")
FORMATS = ("native", "int4")


def check_combination(tier: str, fmt: str = "native", pooled: bool = False) -> None:
    """Refuse a tier / format / pool combination that storage cannot build (ValueError, one sentence)."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "int4" and tier != "ram":
        raise ValueError("the int4 format keeps its packed KV in host RAM: use tier='ram'")
    if pooled and (tier != "ram" or fmt != "native"):
        raise ValueError("a capped host pool holds native rows in host RAM: use tier='ram' without int4")


def row_bytes(fmt: str, head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes one position of one KV head moves (K and V) in a storage format."""
    if fmt == "int4":
        return int4_row_bytes(head_dim, GROUP)
    return 2 * head_dim * torch.empty((), dtype=kv_dtype).element_size()


def read_unit(
    tier: str, fmt: str, head_dim: int, kv_dtype: torch.dtype, directory: str | os.PathLike | None = None
) -> int:
    """Positions of one KV head that one read of the tier brings back whole: a disk block's
    records (the file keeps a head's positions in order, so a block holds consecutive ones), one
    row for the tiers that gather rows (RAM, pinned, int4). A selector that chooses in these
    units attends every row it reads."""
    if tier != "disk" or fmt != "native":
        return 1
    block = block_size(kv_directory(directory))
    return max(block // record_bytes(row_bytes(fmt, head_dim, kv_dtype), block), 1)


def roundtrip(fmt: str, x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """What a row holds after it was stored and read back, in x's dtype: lets an evaluator
    reproduce a tier exactly without one."""
    if fmt == "int4":
        # The int4 tier quantizes the value in its storage dtype and dequantizes straight to fp32.
        return fake_quantize_int4(x.to(kv_dtype).to(torch.float32), GROUP).to(x.dtype)
    return x.to(kv_dtype).to(x.dtype)


class Storage:
    """Builds the slow tier of every offloaded layer of one cache and owns what they share.

    tier, fmt:     where and how rows are stored (see `check_combination`);
    kv_dtype:      storage dtype (None: the dtype the KV is computed in);
    capacity:      positions a disk file is laid out for (prompt + generated tokens, or the
                   model's context when the generation's length is unknown);
    reserve:       positions the generation will reach, if known (prompt + max_new_tokens):
                   the disk space the files allocate up front; unknown, the first append's,
                   grown on demand;
    layers:        how many tiers this factory will build: the disk space for all of them is
                   checked once, before the first byte is written;
    host_capacity: None, or the fraction of `pool_positions` (default: the first append) a
                   capped host pool keeps per (batch row, KV head); only for `new_tier(pooled=True)`;
    block_cache:   the fraction of a disk tier's blocks also kept in RAM as a read cache;
    copy_engine:   how the pinned tier moves rows to the compute device: ``auto`` (CUDA streams
                   when the device is a GPU), ``cuda``, ``threads`` (the same protocol on CPU
                   threads), or a `CopyEngine` instance;
    read_chunk:    the most bytes one round of a disk tier's gather reads (None: `READ_CHUNK`).
    """

    def __init__(
        self,
        tier: str = "ram",
        fmt: str = "native",
        kv_dtype: torch.dtype | None = None,
        *,
        capacity: int,
        layers: int,
        reserve: int | None = None,
        directory: str | os.PathLike | None = None,
        io_threads: int = 4,
        device: torch.device | str | None = None,
        host_capacity: float | None = None,
        pool_positions: int | None = None,
        eviction: str = "counter",
        block_cache: float = 0.0,
        copy_engine: str | CopyEngine = "auto",
        read_chunk: int | None = None,
    ) -> None:
        check_combination(tier, fmt, pooled=host_capacity is not None)
        self.tier, self.fmt, self.kv_dtype = tier, fmt, kv_dtype
        self.capacity, self.layers, self.reserve = capacity, layers, reserve
        if tier == "disk" and fmt == "native" and layers:
            check_space(directory, 0)  # an unusable directory fails now, before any model work
        self.copy_engine = copy_engine
        self._engines: dict[str, CopyEngine] = {}  # one per compute device (a split model has several)
        if tier == "pinned":
            self.engine_for(device)  # an unusable engine fails now, before any model work
        self.directory, self.io_threads, self.device = directory, io_threads, device
        self.host_capacity, self.pool_positions, self.eviction = host_capacity, pool_positions, eviction
        self.block_cache, self.read_chunk = block_cache, read_chunk
        self.stats = TransferStats()
        self._threads: IOThreads | None = None
        self._reserved = False

    def engine_for(self, device: torch.device | str | None) -> CopyEngine:
        """The copy engine of the pinned tiers whose rows go to `device`."""
        if isinstance(self.copy_engine, CopyEngine):
            return self.copy_engine
        key = str(device)
        if key not in self._engines:
            try:
                self._engines[key] = new_copy_engine(self.copy_engine, device)
            except (RuntimeError, ValueError) as exc:
                raise KVStorageError(errno.ENODEV, str(exc)) from None
        return self._engines[key]

    def dtype_for(self, compute: torch.dtype) -> torch.dtype:
        return self.kv_dtype or compute

    def new_tier(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        compute_dtype: torch.dtype,
        *,
        pooled: bool = False,
        positions: int = 0,
        device: torch.device | str | None = None,
    ) -> KVTier:
        """The tier of one layer; `positions` is the length of its first append (the prompt),
        which sizes a capped pool unless `pool_positions` was given; `device`: where the layer
        computes (default: the storage's device)."""
        dtype = self.dtype_for(compute_dtype)
        stats = self.stats
        if pooled:
            if self.host_capacity is None:
                raise ValueError("a pooled tier needs host_capacity")
            slots = capacity_slots(self.host_capacity, self.pool_positions or positions)
            return PooledTier(batch, kv_heads, head_dim, dtype, stats, slots, self.eviction)
        if self.fmt == "int4":
            return Int4RamTier(batch, kv_heads, head_dim, dtype, stats, group=GROUP, capacity=self.pool_positions or 0)
        if self.tier == "ram":
            return RamTier(batch, kv_heads, head_dim, dtype, stats, capacity=self.pool_positions or 0)
        if self.tier == "disk":
            reserve = min(self.reserve or positions or 1, self.capacity)
            if not self._reserved:
                rows = row_bytes("native", head_dim, dtype)
                check_space(
                    self.directory, self.layers * reserved_bytes(self.directory, batch * kv_heads, rows, reserve)
                )
                self._reserved = True
            if self._threads is None:
                self._threads = IOThreads(self.io_threads)
                self._finalizer = weakref.finalize(self, self._threads.shutdown, False)
            return DiskTier(
                batch, kv_heads, head_dim, dtype, stats, self.capacity, self.directory, threads=self._threads,
                cache_fraction=self.block_cache, reserve=reserve, read_chunk=self.read_chunk,
            )  # fmt: skip
        engine = self.engine_for(device if device is not None else self.device)
        return PinnedTier(batch, kv_heads, head_dim, dtype, stats, engine, capacity=self.pool_positions or 0)

    def beside_compute(self) -> dict[str, int]:
        """What the tiers share in the compute's memory: the disk tiers' read and staging buffers."""
        return {"tier_buffers": self._threads.nbytes} if self._threads is not None else {}

    def close(self) -> None:
        """Stop the shared I/O threads (after the tiers are closed); idempotent."""
        threads, self._threads = self._threads, None
        if threads is not None:
            self._finalizer.detach()
            threads.shutdown(wait=True)
        engines, self._engines = list(self._engines.values()), {}
        if isinstance(self.copy_engine, CopyEngine):
            engines.append(self.copy_engine)
        for engine in engines:
            engine.close()


__all__ = [
    "COPY_ENGINES",
    "CopyEngine",
    "CudaCopyEngine",
    "ThreadCopyEngine",
    "EVICTIONS",
    "FORMATS",
    "TIERS",
    "DiskTier",
    "Int4RamTier",
    "KVCapacityError",
    "KVStorageError",
    "KVTier",
    "PinnedTier",
    "PooledTier",
    "RamTier",
    "Storage",
    "TransferStats",
    "check_combination",
    "read_unit",
    "roundtrip",
    "row_bytes",
    "rows_dtype",
]
