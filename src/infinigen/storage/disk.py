"""A slow tier on local disk: one layer's full K and V in a file read with O_DIRECT.

The bytes really cross the disk: the file is opened with ``O_DIRECT`` so neither writes nor
reads go through the page cache, and every buffer handed to the kernel is page aligned
(anonymous ``mmap``) and a whole number of blocks long.

File layout
-----------
The file holds ``B * Hkv`` regions, one per (batch row, KV head), in that order. Each region
has room for ``capacity`` positions and is padded to a whole number of blocks, so every region
starts on a block boundary. Inside a region the positions follow each other in order, and a
position's record is its K row immediately followed by its V row
(``2 * head_dim * itemsize`` bytes, 256 B for d=64 in fp16)::

    region(b, h) = [K_0 V_0][K_1 V_1][K_2 V_2] ... [K_{capacity-1} V_{capacity-1}] pad

Why this layout:

* A decode step selects positions independently per (b, h) and always needs both K and V of a
  selected position. Keeping K and V of a position adjacent makes one selected row one
  contiguous record, so it costs one block read instead of two (separate K and V files would
  double the blocks touched).
* Within a region, nearby positions share a block (4096 / record positions per 4 KiB block,
  16 for d=64 fp16). Attention selections cluster (recent tokens, sink tokens, local runs), so
  neighbouring selected positions are mostly served by the same or adjacent blocks.
* A selection, sorted ascending per (b, h), maps to an ascending list of blocks; blocks whose gap
  is at most ``coalesce_gap_blocks`` are merged into one larger read, because reading a small gap
  costs less than issuing another request. The merged runs are read with several requests in
  flight, which is what fast SSDs need to reach their bandwidth.
* Appends only ever touch the end of each region: decode writes exactly the block holding the
  new position (one 4 KiB write per (b, h)), prefill one large contiguous write per (b, h).
  The last, partially filled block of every region is also kept in RAM, so an append never has
  to read anything back; it is written through on every append so the file is always complete.
* ``read_all`` of a prefix is one sequential read per region.

Every read is counted in the tier's ``TransferStats`` with the bytes actually read from disk,
amplification included; ``bytes_useful`` holds the bytes of the rows asked for, so
``read_amplification`` = bytes read / bytes useful.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from infinigen.storage.base import KVCapacityError, KVStorageError, KVTier, TransferStats

ENV_DIR = "INFINIGEN_KV_DIR"
_MIN_BLOCK = 4096
_STAGE_KEEP = 1 << 20  # append staging buffers up to this size are kept and reused


def default_directory() -> Path:
    """``$INFINIGEN_KV_DIR`` if set, else the system temporary directory."""
    return Path(os.environ.get(ENV_DIR) or tempfile.gettempdir())


def check_space(directory: str | os.PathLike | None, nbytes: int) -> Path:
    """Fail early and clearly when `directory` cannot take `nbytes` of KV files (a directory
    that cannot be created, is not one, is not writable, or lacks the room). The storage
    factory calls it once for every layer's file before a generation writes anything; a
    tier made on its own calls it for its file."""
    d = Path(directory) if directory is not None else default_directory()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KVStorageError(e.errno, f"KV directory {d} does not exist and cannot be created: {e.strerror}") from e
    if not d.is_dir():
        raise KVStorageError(errno.ENOTDIR, f"KV directory {d} is not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise KVStorageError(errno.EACCES, f"KV directory {d} is not writable")
    free = shutil.disk_usage(d).free
    if free < nbytes:
        raise KVStorageError(
            errno.ENOSPC,
            f"not enough free space in {d} for the KV cache: needs {nbytes} bytes, {free} free; "
            f"point kv_dir (or ${ENV_DIR}) at a disk with more room, or lower the context or batch",
        )
    return d


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _aligned(nbytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned buffer (what O_DIRECT requires)."""
    return mmap.mmap(-1, max(nbytes, 1))


class IOThreads:
    """The threads disk tiers read with: one `control` thread runs each gather (plan, reads,
    unpacking) and `io` runs its reads, several in flight. Separate pools, so that a gather
    waiting for its reads can never starve them. One instance serves every layer of a cache."""

    def __init__(self, readers: int) -> None:
        if readers < 1:
            raise ValueError(f"readers must be at least 1, got {readers}")
        self.readers = readers
        self.control = ThreadPoolExecutor(1, thread_name_prefix="infinigen-gather")
        self.io = ThreadPoolExecutor(readers, thread_name_prefix="infinigen-io")

    def shutdown(self, wait: bool = True) -> None:
        self.control.shutdown(wait=wait)
        self.io.shutdown(wait=wait)


class _Resources:
    """What must be released with the tier; holds no reference to the tier itself."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.own_threads: IOThreads | None = None


def _release(res: _Resources, wait: bool = False) -> None:
    threads, res.own_threads = res.own_threads, None
    if threads is not None:
        threads.shutdown(wait=wait)
    if res.fd >= 0:
        try:
            os.close(res.fd)
        except OSError:
            pass
        res.fd = -1
    try:
        os.unlink(res.path)
    except FileNotFoundError:
        pass


class DiskTier(KVTier):
    """One layer's K and V in a file on disk, read with O_DIRECT (see the module docstring).

    ``capacity`` is the most positions the tier will ever hold; the file is sized for it up
    front. ``directory`` defaults to ``$INFINIGEN_KV_DIR`` or the system temporary directory;
    every tier uses its own unique file there, removed by ``close()``, by garbage collection,
    at interpreter exit, or when a ``with`` block is left. ``threads`` are the I/O threads to
    read with (shared by the layers of a cache); without them the tier starts its own
    ``readers`` and stops them on close.

    If the filesystem refuses O_DIRECT (tmpfs, some network filesystems) a
    ``KVStorageError`` names the directory, unless ``allow_buffered=True``: then the file is
    used through the page cache, which is dropped after every write and before every read
    (``direct`` is False).
    """

    max_request_bytes = 1 << 20  # a merged run longer than this is read in several requests

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
    ) -> None:
        super().__init__(batch, kv_heads, head_dim, dtype, stats)
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 position, got {capacity}")
        if coalesce_gap_blocks < 0:
            raise ValueError(f"coalesce_gap_blocks must be >= 0, got {coalesce_gap_blocks}")
        self.capacity = int(capacity)
        self.coalesce_gap_blocks = int(coalesce_gap_blocks)
        self.directory = Path(directory) if directory is not None else default_directory()
        self.record_bytes = self.row_bytes
        self.regions = batch * kv_heads
        self.bytes_read = 0  # bytes read by this tier (amplification included)
        self.bytes_useful = 0  # bytes of the rows asked for
        self._closed = False
        self._stage: mmap.mmap | None = None

        check_space(self.directory, 0)
        self.block_size = self._block_size()
        self.region_bytes = _round_up(self.capacity * self.record_bytes, self.block_size)
        self.file_bytes = self.region_bytes * self.regions
        check_space(self.directory, self.file_bytes)
        try:
            fd, path = tempfile.mkstemp(prefix="infinigen-kv-", suffix=".bin", dir=self.directory)
        except OSError as e:
            raise KVStorageError(e.errno, f"cannot create the KV file in {self.directory}: {e.strerror}") from e
        os.close(fd)
        self.path = Path(path)
        self._res = _Resources(path)
        self._finalizer = weakref.finalize(self, _release, self._res)
        try:
            if threads is None:
                threads = self._res.own_threads = IOThreads(readers)
            self.threads = threads
            self.direct = self._open(allow_buffered)
        except BaseException:
            self._finalizer()
            raise
        # The last, partially filled block of every region (see "Appends" in the docstring).
        self._tails = torch.zeros(self.regions, self.block_size, dtype=torch.uint8)

    # ------------------------------------------------------------------ setup
    def _block_size(self) -> int:
        try:
            fs_block = os.statvfs(self.directory).f_bsize
        except (OSError, AttributeError):
            fs_block = 0
        block = max(int(fs_block), _MIN_BLOCK)
        return block if block % 512 == 0 else _MIN_BLOCK

    def _open(self, allow_buffered: bool) -> bool:
        """Open the file with O_DIRECT (True), or buffered if refused and allowed (False)."""
        direct_flag = getattr(os, "O_DIRECT", 0)
        reason = "this platform has no O_DIRECT"
        if direct_flag:
            try:
                self._res.fd = os.open(self._res.path, os.O_RDWR | direct_flag)
                self._allocate()
                self._probe()
                return True
            except KVStorageError:
                raise
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise KVStorageError(e.errno, f"cannot open the KV file in {self.directory}: {e.strerror}") from e
                if self._res.fd >= 0:
                    os.close(self._res.fd)
                    self._res.fd = -1
                reason = f"the filesystem refuses O_DIRECT ({e.strerror})"
        if not allow_buffered:
            raise KVStorageError(
                errno.EINVAL,
                f"cannot use {self.directory} for the disk KV tier: {reason}. Use a directory on a "
                f"local disk filesystem (ext4, xfs, ...; e.g. /var/tmp) via directory= or ${ENV_DIR}, "
                "or pass allow_buffered=True to go through the page cache (the reads are then not "
                "guaranteed to come from disk)",
            )
        self._res.fd = os.open(self._res.path, os.O_RDWR)
        self._allocate()
        return False

    def _probe(self) -> None:
        """Some filesystems accept O_DIRECT at open and refuse it at the first I/O."""
        buf = _aligned(self.block_size)
        self._pwrite(memoryview(buf), 0)
        self._preadv(memoryview(buf), 0)

    def _allocate(self) -> None:
        fd = self._res.fd
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, self.file_bytes)
            else:
                os.ftruncate(fd, self.file_bytes)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                os.ftruncate(fd, self.file_bytes)
            else:
                raise KVStorageError(
                    e.errno,
                    f"cannot reserve {self.file_bytes} bytes for the KV file in {self.directory}: {e.strerror}",
                ) from e

    # ------------------------------------------------------------------ low-level I/O
    def _pwrite(self, buf: memoryview, offset: int) -> None:
        try:
            done = os.pwrite(self._res.fd, buf, offset)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            raise KVStorageError(e.errno, f"writing the KV file {self.path} failed: {e.strerror}") from e
        if done != len(buf):
            raise KVStorageError(
                errno.EIO, f"short write to the KV file {self.path}: {done} of {len(buf)} bytes at offset {offset}"
            )

    def _preadv(self, buf: memoryview, offset: int) -> None:
        try:
            done = os.preadv(self._res.fd, [buf], offset)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            raise KVStorageError(e.errno, f"reading the KV file {self.path} failed: {e.strerror}") from e
        if done != len(buf):
            raise KVStorageError(
                errno.EIO, f"short read from the KV file {self.path}: {done} of {len(buf)} bytes at offset {offset}"
            )

    def _drop_cache(self) -> None:
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._res.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _read_many(self, requests: list[tuple[memoryview, int]]) -> None:
        """Issue (buffer, offset) reads, up to `threads` in flight."""
        if not requests:
            return
        readers = self.threads.readers
        if len(requests) == 1 or readers == 1:
            for buf, off in requests:
                self._preadv(buf, off)
            return
        io = self.threads.io
        parts = min(readers, len(requests))

        def run(chunk):
            for buf, off in chunk:
                self._preadv(buf, off)

        futures = [io.submit(run, requests[i::parts]) for i in range(parts)]
        for f in futures:
            f.result()

    def _check_open(self) -> None:
        if self._closed or self._res.fd < 0:
            raise ValueError(f"disk KV tier {self.path} is closed")

    # ------------------------------------------------------------------ appends
    def _append(self, keys, values, valid) -> None:
        self._check_open()
        n = keys.shape[2]
        if self.length + n > self.capacity:
            raise KVCapacityError(
                f"cannot append {n} positions to {self.length}: the disk KV tier was sized for "
                f"{self.capacity} positions (capacity=)"
            )
        rec, blk = self.record_bytes, self.block_size
        k = keys.detach().to("cpu", self.dtype)
        v = values.detach().to("cpu", self.dtype)
        records = torch.cat([k, v], dim=-1).contiguous().view(torch.uint8).reshape(self.regions, n * rec)

        begin = self.length * rec  # byte offset of the first new record within a region
        end = begin + n * rec
        start = begin // blk * blk  # the write covers whole blocks [start, stop)
        stop = _round_up(end, blk)
        span = stop - start
        lead = begin - start  # bytes of the kept tail block in front of the new records

        need = self.regions * span
        if need <= _STAGE_KEEP:
            if self._stage is None or len(self._stage) < need:
                self._stage = _aligned(max(need, self.regions * blk))
            buf = self._stage
        else:
            buf = _aligned(need)
        staged = torch.frombuffer(buf, dtype=torch.uint8, count=need).view(self.regions, span)
        if lead:
            staged[:, :lead] = self._tails[:, :lead]
        staged[:, lead : lead + n * rec] = records
        if lead + n * rec < span:
            staged[:, lead + n * rec :] = 0

        view = memoryview(buf)
        writes = [(view[r * span : (r + 1) * span], r * self.region_bytes + start) for r in range(self.regions)]
        if span >= (64 << 10) and self.regions > 1 and self.threads.readers > 1:
            io = self.threads.io
            for f in [io.submit(self._pwrite, b, off) for b, off in writes]:
                f.result()
        else:
            for b, off in writes:
                self._pwrite(b, off)
        self._drop_cache()

        tail_start = end // blk * blk
        if end > tail_start:
            self._tails[:, : end - tail_start] = staged[:, tail_start - start : end - start]
        self.length += n

    # ------------------------------------------------------------------ reads
    def _plan(self, regions: np.ndarray, pos: np.ndarray):
        """Blocks touched by the records, merged into runs. Returns (runs, record offsets in
        the read buffer, buffer bytes); runs are (first block, blocks, buffer block offset)."""
        rec, blk = self.record_bytes, self.block_size
        start = regions * self.region_bytes + pos * rec  # file offset of every record
        first = start // blk
        count = (start + rec - 1) // blk - first + 1
        if int(count.max()) == 1:
            blocks = first
        else:
            base = np.repeat(np.cumsum(count) - count, count)
            blocks = np.repeat(first, count) + (np.arange(int(count.sum())) - base)
        blocks = np.unique(blocks)
        cut = np.nonzero(np.diff(blocks) > self.coalesce_gap_blocks + 1)[0] + 1
        run_first = blocks[np.concatenate(([0], cut))]
        run_last = blocks[np.concatenate((cut - 1, [len(blocks) - 1]))]
        run_len = run_last - run_first + 1
        run_buf = np.cumsum(run_len) - run_len
        which = np.searchsorted(run_first, first, side="right") - 1
        offsets = (run_buf[which] - run_first[which]) * blk + start
        return (run_first, run_len, run_buf), offsets, int(run_len.sum()) * blk

    def _requests(self, runs, view: memoryview) -> list[tuple[memoryview, int]]:
        blk = self.block_size
        per = max(self.max_request_bytes // blk, 1)
        out = []
        for f, n, b in zip(*(r.tolist() for r in runs)):
            for i in range(0, n, per):
                m = min(per, n - i)
                out.append((view[(b + i) * blk : (b + i + m) * blk], (f + i) * blk))
        return out

    def _rows(self, buf: mmap.mmap, nbytes: int, offsets: np.ndarray) -> torch.Tensor:
        """The records at byte `offsets` of the read buffer, as [m, 2d] of the stored dtype."""
        rec = self.record_bytes
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
        if not (offsets % rec).any():
            rows = raw[: nbytes // rec * rec].view(-1, rec)[torch.from_numpy(offsets // rec)]
        else:  # records straddle blocks at arbitrary byte offsets
            rows = torch.empty(len(offsets), rec, dtype=torch.uint8)
            step = max((1 << 22) // rec, 1)
            cols = torch.arange(rec)
            for i in range(0, len(offsets), step):
                idx = torch.from_numpy(offsets[i : i + step])[:, None] + cols
                rows[i : i + step] = raw[idx]
        return rows.view(self.dtype)

    def _count(self, nbytes: int, rows: int, seconds: float) -> None:
        useful = rows * self.record_bytes
        self.stats.add(nbytes, rows, seconds, useful_bytes=useful)
        self.bytes_read += nbytes  # a tier's reads run on one control thread: no lock needed
        self.bytes_useful += useful

    def _gather_async(self, indices, valid, device, dtype) -> Future:
        """The reads run on the control thread, so the caller can compute meanwhile; the result
        is counted when they complete."""
        self._check_open()
        idx = indices.detach().to("cpu", torch.int64).clone()
        ok = valid.detach().to("cpu", torch.bool).clone()
        return self.threads.control.submit(self._gather, idx, ok, device, dtype)

    def _gather(self, indices: torch.Tensor, valid: torch.Tensor, device, dtype):
        t0 = time.perf_counter()
        b, h, n = indices.shape
        d = self.head_dim
        flat = valid.nonzero(as_tuple=True)
        pos = indices[flat]
        m = int(pos.numel())
        k = torch.zeros(b, h, n, d, dtype=self.dtype)
        v = torch.zeros_like(k)
        nbytes = 0
        if m:
            regions = (flat[0] * self.kv_heads + flat[1]).numpy()
            runs, offsets, nbytes = self._plan(regions, pos.numpy())
            buf = _aligned(nbytes)
            self._drop_cache()
            self._read_many(self._requests(runs, memoryview(buf)))
            rows = self._rows(buf, nbytes, offsets)
            k[flat] = rows[:, :d]
            v[flat] = rows[:, d:]
        k, v = k.to(device, dtype), v.to(device, dtype)
        self._count(nbytes, m, time.perf_counter() - t0)
        return k, v

    def _read_prefix(self, upto: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Positions [0, upto) of every region as [B, Hkv, upto, d] (stored dtype, CPU) and the
        bytes read: one sequential read per region."""
        self._check_open()
        if not 0 <= upto <= self.length:
            raise IndexError(f"asked for {upto} positions but the tier holds {self.length}")
        d, rec = self.head_dim, self.record_bytes
        if upto == 0:
            empty = torch.empty(self.batch, self.kv_heads, 0, d, dtype=self.dtype)
            return empty, empty.clone(), 0
        span = _round_up(upto * rec, self.block_size)
        nbytes = span * self.regions
        buf = _aligned(nbytes)
        view = memoryview(buf)
        self._drop_cache()
        self._read_many([(view[r * span : (r + 1) * span], r * self.region_bytes) for r in range(self.regions)])
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(self.regions, span)[:, : upto * rec]
        recs = raw.reshape(self.batch, self.kv_heads, upto, rec).view(self.dtype)
        return recs[..., :d].clone(), recs[..., d:].clone(), nbytes

    def _read_all(self, upto, device, dtype):
        t0 = time.perf_counter()
        k, v, nbytes = self._read_prefix(upto)
        k, v = k.to(device, dtype), v.to(device, dtype)
        self._count(nbytes, self.regions * upto, time.perf_counter() - t0)
        return k, v

    def _read_all_async(self, upto, device, dtype) -> Future:
        """One sequential read per region on the control thread: full fetch issues it one layer ahead."""
        self._check_open()
        return self.threads.control.submit(self._read_all, upto, device, dtype)

    def peek_all(self):
        k, v, _ = self._read_prefix(self.length)
        return k, v

    # ------------------------------------------------------------------ reporting / lifetime
    @property
    def read_amplification(self) -> float:
        """Bytes read from disk per byte of the rows asked for (1.0 when nothing was read)."""
        return self.bytes_read / self.bytes_useful if self.bytes_useful else 1.0

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wait for reads in flight, close and remove the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._res.own_threads is not None:
            self._res.own_threads.shutdown(wait=True)
        self._stage = None
        self._finalizer()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "O_DIRECT" if getattr(self, "direct", False) else "buffered"
        return (
            f"DiskTier({self.batch}x{self.kv_heads}x{self.length}/{self.capacity}x{self.head_dim} "
            f"{self.dtype}, {mode}, {getattr(self, 'path', self.directory)})"
        )
