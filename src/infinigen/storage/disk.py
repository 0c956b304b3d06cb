"""A slow tier on local disk: one layer's full K and V in a file read with O_DIRECT.

The bytes really cross the disk: the file is opened with ``O_DIRECT``, so neither writes nor
reads go through the page cache. `DiskTier` is the tier's verbs; each part lives in its own file:

* `layout.py`, `DiskLayout`: where each (batch row, KV head, position) record sits in the file
  (one region per batch row and KV head, K and V of a position side by side, no record across
  a block boundary), the one place the file's offsets are computed;
* `disk_file.py`, `DiskFile`: the unnamed file (it cannot outlive its process), its space
  (checked up front, reserved for the positions the run will reach, grown on demand, a full
  disk reported in one sentence) and its reads and writes; `IOThreads`, the threads and
  buffers the tiers of one cache share;
* `disk_write.py`, `TailWriter`: appends, the last partial block of every region kept in RAM
  and whole blocks written behind the compute;
* `disk_read.py`, `ReadPlan` and `DiskReader`: gathers (blocks merged into runs, read in rounds,
  several requests in flight, through the C gather or its Python reference) and range reads;
* `blockcache.py`, `BlockCache`: RAM copies of the blocks read most.

Every read is counted in the tier's ``TransferStats`` with the bytes actually read from disk,
amplification included; ``useful_bytes`` holds the bytes of the rows asked for that came from
disk, so ``read_amplification`` = bytes read / bytes useful. Rows in the RAM tail or the block
cache are counted as ``cached_bytes``, not as disk reads.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import Future

import torch

from infinigen.storage.base import KVCapacityError, KVTier, TransferStats, scatter_rows
from infinigen.storage.blockcache import BlockCache
from infinigen.storage.disk_file import (
    ENV_DIR,
    SPACE_MARGIN,
    WHERE,
    DiskFile,
    IOThreads,
    check_space,
    default_directory,
    kv_directory,
    reserved_bytes,
)
from infinigen.storage.disk_read import DiskReader, ReadPlan
from infinigen.storage.disk_write import STAGE_KEEP, TailWriter
from infinigen.storage.layout import DiskLayout, block_size, record_bytes

READ_CHUNK = 8 << 20  # by default a gather reads at most about this many bytes at once (`DiskReader.records`)

__all__ = [
    "ENV_DIR",
    "READ_CHUNK",
    "SPACE_MARGIN",
    "STAGE_KEEP",
    "WHERE",
    "DiskLayout",
    "DiskTier",
    "IOThreads",
    "block_size",
    "check_space",
    "default_directory",
    "record_bytes",
    "reserved_bytes",
]


def cache_slots(layout: DiskLayout, fraction: float, positions: int) -> int:
    """Block cache slots for `fraction` of the blocks a tier of `layout` fills with `positions`
    (0: no cache, also where records take whole blocks)."""
    if fraction <= 0 or layout.whole_blocks:
        return 0
    return max(1, math.ceil(fraction * layout.regions * layout.region_blocks(positions)))


def planned_bytes(
    *,
    regions: int,
    row_bytes: int,
    positions: int,
    layers: int,
    block_cache: float,
    read_chunk: int,
    span: int,
    rows: int,
    appended: int,
    directory: str | os.PathLike | None = None,
) -> dict[str, int]:
    """The RAM that `layers` disk tiers of `regions` regions of `row_bytes` rows keep next to
    the compute by the time they hold `positions` (their capacity and reservation), by part:
    each tier's block cache (`block_cache` of its blocks) and its maps, its RAM tails, and the
    buffers the tiers share: the read buffer, for steps that read at most `rows` rows of a
    region and range reads of at most `span` positions in rounds of `read_chunk` bytes, and
    the staging buffer of appends of at most `appended` positions."""
    layout = DiskLayout.in_directory(kv_directory(directory), regions, row_bytes, positions)
    slots = cache_slots(layout, block_cache, positions)
    cache = BlockCache.planned_bytes(slots, layout.block, layout.file_blocks) if slots else (0, 0)
    buffers = ReadPlan.planned_buffer(layout, read_chunk, positions, rows, span)
    buffers += TailWriter.planned_staging(layout, appended)
    return {
        "block_cache": layers * cache[0],
        "metadata": layers * cache[1],
        "tier_buffers": layers * layout.tails_bytes + buffers,
    }


class DiskTier(KVTier):
    """One layer's K and V in a file on disk, read with O_DIRECT (see the module docstring).

    ``capacity`` is the most positions the tier will ever hold; the file is laid out for it.
    ``reserve`` is how many positions get disk blocks up front (default: ``capacity``); more
    are allocated as appends need them. ``directory`` defaults to ``$INFINIGEN_KV_DIR`` or the
    system temporary directory; every tier uses its own unnamed file there, released by
    ``close()``, by garbage collection, when a ``with`` block is left, or when the process ends
    in any way. ``threads`` are the I/O threads to read with (shared by the layers of a cache);
    without them the tier starts its own ``readers`` and stops them on close. ``read_chunk``
    bounds the bytes one round of a gather reads (default ``READ_CHUNK``): the shared read
    buffer holds up to about twice it, so a smaller one keeps less next to the compute at the
    price of more rounds of reads. ``cache_fraction`` of the blocks the reservation fills are
    also kept in RAM (`BlockCache`).

    If the filesystem refuses O_DIRECT (tmpfs, some network filesystems) a
    ``KVStorageError`` names the directory, unless ``allow_buffered=True``: then the file is
    used through the page cache, which is dropped after every write and before every read
    (``direct`` is False).
    """

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        stats: TransferStats,
        capacity: int,
        directory: str | os.PathLike | None = None,
        readers: int = 4,
        *,
        threads: IOThreads | None = None,
        allow_buffered: bool = False,
        coalesce_gap_blocks: int = 2,
        cache_fraction: float = 0.0,
        reserve: int | None = None,
        read_chunk: int | None = None,
    ) -> None:
        super().__init__(batch, kv_heads, head_dim, dtype, stats)
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 position, got {capacity}")
        if coalesce_gap_blocks < 0:
            raise ValueError(f"coalesce_gap_blocks must be >= 0, got {coalesce_gap_blocks}")
        if not 0 <= cache_fraction <= 1:
            raise ValueError(f"cache_fraction must be in [0, 1], got {cache_fraction}")
        read_chunk = READ_CHUNK if read_chunk is None else int(read_chunk)
        if read_chunk < 1:
            raise ValueError(f"read_chunk must be at least 1 byte, got {read_chunk}")
        self.capacity = int(capacity)
        self.directory = kv_directory(directory)
        self.regions = batch * kv_heads
        self.bytes_read = 0  # bytes read from disk by this tier (amplification included)
        self.bytes_useful = 0  # bytes of the rows asked for that came from disk

        check_space(self.directory, 0)
        self.layout = DiskLayout.in_directory(self.directory, self.regions, self.row_bytes, self.capacity)
        reserved = min(self.capacity, max(int(reserve if reserve is not None else self.capacity), 1))
        check_space(self.directory, self.layout.reserved_bytes(reserved))
        self.file = DiskFile(self.layout, self.directory, reserved, threads, readers, allow_buffered)
        self.threads, self.direct = self.file.threads, self.file.direct
        self.writer = TailWriter(self.layout, self.file, dtype, head_dim)
        # A block cache sized on the positions this run reaches (the reservation), not on the layout.
        slots = cache_slots(self.layout, cache_fraction, reserved)
        self.cache = BlockCache(slots, self.layout.block, self.layout.file_blocks) if slots else None
        self.reader = DiskReader(
            self.layout, self.file, self.writer.tails, self.cache, int(coalesce_gap_blocks), read_chunk, dtype, head_dim
        )

    # The layout's numbers, as the tier's own (reports and tests read them).
    block_size = property(lambda self: self.layout.block)
    record_bytes = property(lambda self: self.layout.record)
    region_bytes = property(lambda self: self.layout.region_bytes)
    file_bytes = property(lambda self: self.layout.file_bytes)
    read_chunk = property(lambda self: self.reader.read_chunk)

    planned_bytes = staticmethod(planned_bytes)  # what a plan of the compute's memory asks the tier

    # ------------------------------------------------------------------ appends
    def _append(self, keys, values, valid) -> None:
        self.file.check_open()
        self.writer.raise_errors(wait=False)
        n = keys.shape[2]
        if self.length + n > self.capacity:
            raise KVCapacityError(
                f"cannot append {n} positions to {self.length}: the disk KV tier was sized for "
                f"{self.capacity} positions (capacity=)"
            )
        self.file.space.reserve(self.length + n)
        self.writer.append(keys, values, self.length)
        self.length += n

    def flush(self) -> None:
        """Wait for the blocks written behind; raise the first write error."""
        self.writer.raise_errors(wait=True)

    # ------------------------------------------------------------------ gathers
    def _gather_async(self, indices, valid, device, dtype, out=None) -> Future:
        """The reads run on the control thread, so the caller can compute meanwhile; the result
        is counted when they complete."""
        self.file.check_open()
        self.writer.raise_errors(wait=False)
        idx = indices.detach().to("cpu", torch.int64).clone()
        ok = valid.detach().to("cpu", torch.bool).clone()
        return self.threads.control.submit(self._gather, idx, ok, device, dtype, out, self.length)

    def _gather(self, indices: torch.Tensor, valid: torch.Tensor, device, dtype, out=None, length=None):
        t0 = time.perf_counter()
        d = self.head_dim
        flat = valid.nonzero(as_tuple=True)
        pos = indices[flat]
        m = int(pos.numel())
        rows = torch.empty(m, self.layout.record, dtype=torch.uint8)
        nbytes = reads = disk_rows = ram_rows = 0
        if m:
            region, p = (flat[0] * self.kv_heads + flat[1]).numpy(), pos.numpy()
            tail_at = self.layout.tail_offsets(region, p, self.length if length is None else length)
            nbytes, reads, disk_rows, ram_rows = self.reader.records(self.layout.offsets(region, p), tail_at, rows)
        kv = rows[:, : self.row_bytes].view(self.dtype)
        k, v = scatter_rows(flat, kv[:, :d], kv[:, d:], (*indices.shape, d), device, dtype, out)
        self._count(nbytes, disk_rows, ram_rows, time.perf_counter() - t0, reads)
        return k, v

    # ------------------------------------------------------------------ range reads
    def _read_span(self, start: int, stop: int, out=None, device=None, dtype=None):
        """Positions [start, stop) as [B, Hkv, stop - start, d], the bytes read and the reads
        (`DiskReader.span`)."""
        self.file.check_open()
        if not 0 <= start <= stop <= self.length:
            raise IndexError(f"asked for positions [{start}, {stop}) but the tier holds {self.length}")
        return self.reader.span(start, stop, (self.batch, self.kv_heads), self.length, out, device, dtype)

    def _read_range(self, start, stop, device, dtype, out=None):
        t0 = time.perf_counter()
        k, v, nbytes, reads = self._read_span(start, stop, out, device, dtype)
        tail_rows = max(stop - max(start, self.layout.tail_position(self.length)), 0)
        rows = stop - start
        self._count(
            nbytes, self.regions * (rows - tail_rows), self.regions * tail_rows, time.perf_counter() - t0, reads
        )
        return k, v

    def _read_range_async(self, start, stop, device, dtype, out=None) -> Future:
        """One sequential read per region on the control thread: full fetch issues it one layer
        ahead, a layer read in chunks one chunk ahead."""
        self.file.check_open()
        self.writer.raise_errors(wait=False)
        return self.threads.control.submit(self._read_range, start, stop, device, dtype, out)

    def peek_all(self):
        self.flush()
        k, v, _, _ = self.threads.control.submit(self._read_span, 0, self.length).result()  # where the buffer is used
        return k, v

    def _count(self, nbytes: int, disk_rows: int, ram_rows: int, seconds: float, reads: int = 0) -> None:
        useful = disk_rows * self.row_bytes
        cached = ram_rows * self.row_bytes
        self.stats.add(nbytes, disk_rows + ram_rows, seconds, useful_bytes=useful, cached_bytes=cached, reads=reads)
        self.bytes_read += nbytes  # a tier's reads run on one control thread: no lock needed
        self.bytes_useful += useful

    # ------------------------------------------------------------------ reporting / lifetime
    def stored_bytes(self) -> int:
        """The file's allocated blocks (the positions reserved or reached, records padded)."""
        return self.file.space.stored_bytes()

    def beside_compute(self) -> dict[str, int]:
        """RAM kept for the disk: the block cache's copies and its maps, the unwritten tails of
        the regions and the aligned staging and read buffers (reused by every write and gather)."""
        own = self.threads.nbytes if self.file.owns_threads else 0  # shared threads: counted by their Storage
        out = {"tier_buffers": self.writer.tails.nbytes + own}
        if self.cache is not None:
            out["block_cache"] = self.cache.nbytes
            out["metadata"] = self.cache.maps_nbytes
        return out

    @property
    def read_amplification(self) -> float:
        """Bytes read from disk per byte of the rows asked for (1.0 when nothing was read)."""
        return self.bytes_read / self.bytes_useful if self.bytes_useful else 1.0

    @property
    def closed(self) -> bool:
        return self.file.closed

    def close(self) -> None:
        """Wait for reads and writes in flight, then close the file, which frees it (idempotent)."""
        if self.file.closed:
            return
        self.file.closed = True  # before the writes settle: no new work is accepted meanwhile
        self.writer.settle()  # blocks written behind: let them land before the file goes
        self.file.close()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "O_DIRECT" if getattr(self, "direct", False) else "buffered"
        return (
            f"DiskTier({self.batch}x{self.kv_heads}x{self.length}/{self.capacity}x{self.head_dim} "
            f"{self.dtype}, {mode}, {self.directory})"
        )
