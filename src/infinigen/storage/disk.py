"""A slow tier on local disk: one layer's full K and V in a file read with O_DIRECT.

The bytes really cross the disk: the file is opened with ``O_DIRECT`` so neither writes nor
reads go through the page cache, and every buffer handed to the kernel is page aligned
(anonymous ``mmap``) and a whole number of blocks long.

File layout
-----------
The file holds ``B * Hkv`` regions, one per (batch row, KV head), in that order. Each region
has room for ``capacity`` positions and is padded to a whole number of blocks, so every region
starts on a block boundary. Inside a region the positions follow each other in order, and a
position's record is its K row immediately followed by its V row, padded to a power of two
that divides the block (or to whole blocks), so that no record straddles a block boundary
(256 B for d = 64 in fp16: 16 per 4 KiB block)::

    region(b, h) = [K_0 V_0][K_1 V_1][K_2 V_2] ... [K_{capacity-1} V_{capacity-1}] pad

Why this layout:

* A decode step selects positions independently per (b, h) and always needs both K and V of a
  selected position. Keeping K and V of a position adjacent makes one selected row one
  contiguous record, so it costs one block read instead of two.
* Within a region, nearby positions share a block. Attention selections cluster (recent tokens,
  sink tokens, local runs), so neighbouring selected positions are mostly served by the same or
  adjacent blocks.
* A selection, sorted ascending per (b, h), maps to an ascending list of blocks; blocks whose gap
  is at most ``coalesce_gap_blocks`` are merged into one larger read, because reading a small gap
  costs less than issuing another request. The merged runs are read with several requests in
  flight, which is what fast SSDs need to reach their bandwidth.
* ``read_range`` (a prefix, or a chunk of one) is one sequential read per region.

Appends (write-behind)
----------------------
The last, partially filled block of every region (the *tail*) lives in RAM; only whole blocks
are written. A prefill writes its whole blocks at once; a decode step only fills the tail, and
when a block fills it is handed to the I/O thread that also runs the gathers, so the compute
thread never waits for a write and a gather, queued behind it, always sees it on disk. Rows in
the tail are served from RAM (counted as ``cached_bytes``, not as disk reads). A write that
fails is reported by the tier's next append, read or `flush()`.

Files and space
---------------
A KV file never has a name that outlives its process: it is created unnamed (``O_TMPFILE``)
or, where the file system refuses that, created and unlinked at once, so that nothing is left
in the directory however the process ends (``kill -9`` included); the kernel frees the blocks
when the descriptor closes. The file is laid out for ``capacity`` positions but sparse: disk
blocks are allocated (``posix_fallocate``) for the positions the run is known to reach
(``reserve``) and grown on demand, so that a full disk is reported by the append that needs the
room, as one sentence, and never reaches a write behind the compute.

Every read is counted in the tier's ``TransferStats`` with the bytes actually read from disk,
amplification included; ``useful_bytes`` holds the bytes of the rows asked for that came from
disk, so ``read_amplification`` = bytes read / bytes useful.
"""

from __future__ import annotations

import ctypes
import errno
import math
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

import infinigen.kernels as kernels
from infinigen.storage.base import (
    KVCapacityError,
    KVStorageError,
    KVTier,
    TransferStats,
    copy_prefix,
    prefix_views,
    scatter_rows,
)
from infinigen.storage.blockcache import PINNED, USED, BlockCache

ENV_DIR = "INFINIGEN_KV_DIR"
_MIN_BLOCK = 4096
STAGE_KEEP = 1 << 20  # append staging buffers up to this size are kept and reused
READ_CHUNK = 8 << 20  # by default a gather reads at most about this many bytes at once (see _read_records)


def default_directory() -> Path:
    """``$INFINIGEN_KV_DIR`` if set, else the system temporary directory."""
    return Path(os.environ.get(ENV_DIR) or tempfile.gettempdir())


WHERE = f"kv_dir (--kv-dir, ${ENV_DIR})"  # how a user points the disk tier elsewhere
SPACE_MARGIN = 16  # the space check also asks for 1/SPACE_MARGIN of the KV bytes more, as headroom


def check_space(directory: str | os.PathLike | None, nbytes: int) -> Path:
    """Fail early and clearly when `directory` cannot take `nbytes` of KV files (plus a margin of
    1/SPACE_MARGIN): a directory that does not exist, is not one, is read-only or not writable,
    or lacks the room. A missing directory is not created: a mistyped path must not quietly
    put the KV files on another disk. The storage factory calls it once, for every layer's
    reservation, before a generation writes anything; a tier made on its own calls it for its file."""
    d = Path(directory) if directory is not None else default_directory()
    if not d.exists():
        raise KVStorageError(
            errno.ENOENT, f"KV directory {d} does not exist: create it (mkdir -p {d}) or point {WHERE} at a directory"
        )
    if not d.is_dir():
        raise KVStorageError(errno.ENOTDIR, f"KV directory {d} is not a directory: point {WHERE} at a directory")
    if _read_only(d):
        raise KVStorageError(
            errno.EROFS, f"KV directory {d} is on a read-only file system: point {WHERE} at a writable directory"
        )
    if not os.access(d, os.W_OK | os.X_OK):
        raise KVStorageError(
            errno.EACCES, f"KV directory {d} is not writable by this user: point {WHERE} at a writable directory"
        )
    free = shutil.disk_usage(d).free
    margin = nbytes // SPACE_MARGIN
    if free < nbytes + margin:
        raise KVStorageError(
            errno.ENOSPC,
            f"not enough free space in {d} for the KV cache: needs {nbytes} bytes (+ {margin} margin), {free} "
            f"free; point {WHERE} at a disk with more room, or lower the prompt, max_new_tokens or batch",
        )
    return d


def _read_only(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def block_size(directory: Path) -> int:
    """The I/O block of a KV file in `directory`: the file system's block, at least 4 KiB."""
    try:
        fs_block = os.statvfs(directory).f_bsize
    except (OSError, AttributeError):
        fs_block = 0
    block = max(int(fs_block), _MIN_BLOCK)
    return block if block % 512 == 0 else _MIN_BLOCK


def reserved_bytes(directory: str | os.PathLike | None, regions: int, row_bytes: int, positions: int) -> int:
    """Disk bytes a KV file of `regions` regions allocates for its first `positions` positions."""
    block = block_size(Path(directory) if directory is not None else default_directory())
    return regions * _round_up(positions * record_bytes(row_bytes, block), block)


def grown(positions: int, capacity: int) -> int:
    """Positions to allocate when `positions` are needed: a quarter more (at least 64), so that
    a generation of unknown length grows its files a few times, not at every block."""
    return min(capacity, positions + max(positions // 4, 64))


def _create_unnamed(directory: Path, flags: int) -> int:
    """A new file in `directory` that has no name, so that it disappears with its last descriptor
    however the process ends: ``O_TMPFILE``, or where the file system or kernel refuses it, a
    unique file unlinked as soon as it is open."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            return os.open(directory, tmpfile | os.O_RDWR | flags, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL):
                raise
    fd0, path = tempfile.mkstemp(prefix="infinigen-kv-", suffix=".bin", dir=directory)
    try:
        return os.open(path, os.O_RDWR | flags)
    finally:
        os.unlink(path)
        os.close(fd0)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def range_piece(read_chunk: int, block: int, record: int) -> int:
    """The most positions one piece of a range read takes (`DiskTier._read_span`): whole blocks
    of at most `read_chunk` bytes per region wherever the piece starts (two blocks at least)."""
    return max((read_chunk // block - 1) * block // record, 1)


def record_bytes(row_bytes: int, block: int) -> int:
    """A position's record on disk: its K and V row padded to a power of two that divides the
    block, or to whole blocks, so that no record straddles a block boundary."""
    if row_bytes >= block:
        return _round_up(row_bytes, block)
    size = 1
    while size < row_bytes:
        size *= 2
    return size


def _aligned(nbytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned buffer (what O_DIRECT requires)."""
    return mmap.mmap(-1, max(nbytes, 1))


class IOThreads:
    """The threads disk tiers read with: one `control` thread runs each gather (plan, reads,
    unpacking) and `io` runs its reads, several in flight. Separate pools, so that a gather
    waiting for its reads can never starve them. One instance serves every layer of a cache.

    It also owns the aligned buffers the tiers read and stage writes in, one of each for every
    layer: reads run one at a time on the control thread, and a prefill's writes one layer at a
    time on the compute thread, so a buffer per tier would hold a layer's worth of KV per layer
    (measured: twice dense's KV for full fetch at 4K) for nothing."""

    def __init__(self, readers: int) -> None:
        if readers < 1:
            raise ValueError(f"readers must be at least 1, got {readers}")
        self.readers = readers
        self.control = ThreadPoolExecutor(1, thread_name_prefix="infinigen-gather")
        self.io = ThreadPoolExecutor(readers, thread_name_prefix="infinigen-io")
        self._read: mmap.mmap | None = None
        self.read_address = 0
        self._stage: mmap.mmap | None = None

    def read_buffer(self, nbytes: int) -> mmap.mmap:
        """The read buffer, grown to `nbytes` (page aligned); only the control thread uses it."""
        if self._read is None or len(self._read) < nbytes:
            self._read = _aligned(max(nbytes, 2 * len(self._read or b""), 1 << 16))
            self.read_address = ctypes.addressof(ctypes.c_char.from_buffer(self._read))
        return self._read

    def stage_buffer(self, nbytes: int) -> mmap.mmap:
        """The buffer a prefill's blocks are staged in before they are written (synchronously,
        on the compute thread), grown to `nbytes`."""
        if self._stage is None or len(self._stage) < nbytes:
            self._stage = _aligned(nbytes)
        return self._stage

    @property
    def nbytes(self) -> int:
        return len(self._read or b"") + len(self._stage or b"")

    def shutdown(self, wait: bool = True) -> None:
        self.control.shutdown(wait=wait)
        self.io.shutdown(wait=wait)
        self._read = self._stage = None


class _Resources:
    """What must be released with the tier; holds no reference to the tier itself."""

    def __init__(self) -> None:
        self.fd = -1
        self.aio = 0  # a Linux AIO context for the C gather (0: none)
        self.own_threads: IOThreads | None = None


def _release(res: _Resources, wait: bool = False) -> None:
    threads, res.own_threads = res.own_threads, None
    if threads is not None:
        threads.shutdown(wait=wait)
    if res.aio:
        lib = kernels.library()
        if lib is not None:
            lib.ig_aio_destroy(res.aio)
        res.aio = 0
    if res.fd >= 0:
        try:
            os.close(res.fd)
        except OSError:
            pass
        res.fd = -1


class DiskTier(KVTier):
    """One layer's K and V in a file on disk, read with O_DIRECT (see the module docstring).

    ``capacity`` is the most positions the tier will ever hold; the file is laid out for it.
    ``reserve`` is how many positions get disk blocks up front (default: ``capacity``); more
    are allocated as appends need them. ``directory`` defaults to ``$INFINIGEN_KV_DIR`` or the
    system temporary directory; every tier uses its own unnamed file there (see "Files and
    space"), released by ``close()``, by garbage collection, when a ``with`` block is left, or
    when the process ends in any way. ``threads`` are the I/O threads to read with (shared by
    the layers of a cache); without them the tier starts its own ``readers`` and stops them on
    close. ``read_chunk`` bounds the bytes one round of a gather reads (default ``READ_CHUNK``):
    the shared read buffer holds up to about twice it, so a smaller one keeps less next to the
    compute at the price of more rounds of reads.

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
        self.read_chunk = READ_CHUNK if read_chunk is None else int(read_chunk)
        if self.read_chunk < 1:
            raise ValueError(f"read_chunk must be at least 1 byte, got {read_chunk}")
        self.capacity = int(capacity)
        self.coalesce_gap_blocks = int(coalesce_gap_blocks)
        self.directory = Path(directory) if directory is not None else default_directory()
        self.regions = batch * kv_heads
        self.bytes_read = 0  # bytes read from disk by this tier (amplification included)
        self.bytes_useful = 0  # bytes of the rows asked for that came from disk
        self._closed = False
        self._pending: list[Future] = []  # block writes handed to the I/O thread

        check_space(self.directory, 0)
        self.block_size = block_size(self.directory)
        self.record_bytes = record_bytes(self.row_bytes, self.block_size)
        self.region_bytes = _round_up(self.capacity * self.record_bytes, self.block_size)
        self.file_bytes = self.region_bytes * self.regions
        self.reserved = min(self.capacity, max(int(reserve if reserve is not None else self.capacity), 1))
        check_space(self.directory, reserved_bytes(self.directory, self.regions, self.row_bytes, self.reserved))
        self._allocated = 0  # positions of every region with disk blocks allocated
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _release, self._res)
        try:
            if threads is None:
                threads = self._res.own_threads = IOThreads(readers)
            self.threads = threads
            self.direct = self._open(allow_buffered)
            lib = kernels.library()
            if lib is not None:
                self._res.aio = int(lib.ig_aio_setup(256))  # 0 where AIO is unavailable: pread then
        except BaseException:
            self._finalizer()
            raise
        # The last, partially filled block of every region (see "Appends" in the docstring).
        self._tails = torch.zeros(self.regions, self.block_size, dtype=torch.uint8)
        # A block cache sized on the positions this run reaches (the reservation), not on the layout.
        file_blocks = self.file_bytes // self.block_size
        self.cache: BlockCache | None = None
        if cache_fraction > 0 and self.record_bytes <= self.block_size:
            run_blocks = self.regions * (
                _round_up(self.reserved * self.record_bytes, self.block_size) // self.block_size
            )
            self.cache = BlockCache(max(1, math.ceil(cache_fraction * run_blocks)), self.block_size, file_blocks)

    # ------------------------------------------------------------------ setup
    def _open(self, allow_buffered: bool) -> bool:
        """Create the unnamed file with O_DIRECT (True), or buffered if refused and allowed (False)."""
        direct_flag = getattr(os, "O_DIRECT", 0)
        reason = "this platform has no O_DIRECT"
        if direct_flag:
            try:
                self._res.fd = _create_unnamed(self.directory, direct_flag)
                self._allocate()
                self._probe()
                return True
            except KVStorageError:
                raise
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise KVStorageError(e.errno, f"cannot create a KV file in {self.directory}: {e.strerror}") from e
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
        try:
            self._res.fd = _create_unnamed(self.directory, 0)
        except OSError as e:
            raise KVStorageError(e.errno, f"cannot create a KV file in {self.directory}: {e.strerror}") from e
        self._allocate()
        return False

    def _probe(self) -> None:
        """Some filesystems accept O_DIRECT at open and refuse it at the first I/O."""
        buf = _aligned(self.block_size)
        self._pwrite(memoryview(buf), 0)
        self._preadv(memoryview(buf), 0)

    def _allocate(self) -> None:
        """Size the file for `capacity` (sparse: no blocks yet) and allocate the reservation."""
        try:
            os.ftruncate(self._res.fd, self.file_bytes)
        except OSError as e:
            raise KVStorageError(
                e.errno, f"cannot size a KV file in {self.directory} to {self.file_bytes} bytes: {e.strerror}"
            ) from e
        self._fallocate = hasattr(os, "posix_fallocate")
        self._reserve(self.reserved)

    def _reserve(self, positions: int) -> None:
        """Disk blocks for the first `positions` of every region, allocated now so that a full
        disk fails here, on the caller's thread, with a sentence. Growing, it asks for a quarter
        more (`grown`) and settles for what is needed when the disk has no more. Where the file
        system cannot allocate ahead, the blocks come with the writes (errors likewise)."""
        if positions <= self._allocated:
            return
        target = grown(positions, self.capacity) if self._allocated else max(positions, self.reserved)
        for want in dict.fromkeys((target, positions)):  # the roomy target, then just what is needed
            try:
                self._allocate_upto(want)
                return
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                    self._fallocate = False
                    self._allocated = target
                    return
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise KVStorageError(
                        e.errno, f"cannot allocate disk space for a KV file in {self.directory}: {e.strerror}"
                    ) from e
                if want == positions:
                    raise KVStorageError(e.errno, self._full(positions, self._bytes_upto(positions))) from e

    def _bytes_upto(self, positions: int) -> int:
        """Bytes still to allocate for the first `positions` of every region."""
        old = _round_up(self._allocated * self.record_bytes, self.block_size)
        new = min(_round_up(positions * self.record_bytes, self.block_size), self.region_bytes)
        return max(new - old, 0) * self.regions

    def _allocate_upto(self, positions: int) -> None:
        if self._fallocate:
            old = _round_up(self._allocated * self.record_bytes, self.block_size)
            new = min(_round_up(positions * self.record_bytes, self.block_size), self.region_bytes)
            for r in range(self.regions):
                if new > old:
                    os.posix_fallocate(self._res.fd, r * self.region_bytes + old, new - old)
        self._allocated = positions

    def _full(self, positions: int, nbytes: int | None = None) -> str:
        """The sentence for a disk that filled up under a run."""
        try:
            free = f"{shutil.disk_usage(self.directory).free} bytes free"
        except OSError:
            free = "free space unknown"
        need = f" needs {nbytes} more bytes," if nbytes else ""
        return (
            f"the disk holding the KV files ({self.directory}) is full: growing a layer's KV to {positions} "
            f"positions{need} {free}; free space there or point {WHERE} at a disk with more room"
        )

    # ------------------------------------------------------------------ low-level I/O
    def _pwrite(self, buf: memoryview, offset: int) -> None:
        try:
            done = os.pwrite(self._res.fd, buf, offset)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise KVStorageError(e.errno, self._full(self.length)) from e
            raise KVStorageError(e.errno, f"writing a KV file in {self.directory} failed: {e.strerror}") from e
        if done != len(buf):
            raise KVStorageError(
                errno.EIO,
                f"short write to a KV file in {self.directory}: {done} of {len(buf)} bytes at offset {offset}",
            )

    def _preadv(self, buf: memoryview, offset: int) -> None:
        try:
            done = os.preadv(self._res.fd, [buf], offset)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            raise KVStorageError(e.errno, f"reading a KV file in {self.directory} failed: {e.strerror}") from e
        if done != len(buf):
            raise KVStorageError(
                errno.EIO,
                f"short read from a KV file in {self.directory}: {done} of {len(buf)} bytes at offset {offset}",
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
            raise ValueError(f"this disk KV tier (in {self.directory}) is closed")

    # ------------------------------------------------------------------ appends
    def _tail_start(self, length: int | None = None) -> int:
        """Byte offset (within a region) of the tail block: the first byte not yet on disk."""
        end = (self.length if length is None else length) * self.record_bytes
        return end // self.block_size * self.block_size

    def _append(self, keys, values, valid) -> None:
        self._check_open()
        self._raise_write_errors(wait=False)
        n = keys.shape[2]
        if self.length + n > self.capacity:
            raise KVCapacityError(
                f"cannot append {n} positions to {self.length}: the disk KV tier was sized for "
                f"{self.capacity} positions (capacity=)"
            )
        self._reserve(self.length + n)
        rec, blk, d = self.record_bytes, self.block_size, self.head_dim
        if n == 1 and rec <= blk:  # a decode step: straight into the RAM tail, converted there
            self._append_one(keys, values)
            return
        width = 2 * d * keys.new_empty((), dtype=self.dtype).element_size()
        k = keys.detach().to("cpu", self.dtype)
        v = values.detach().to("cpu", self.dtype)
        records = torch.cat([k, v], dim=-1).contiguous().view(torch.uint8).reshape(self.regions, n, width)

        begin = self.length * rec  # byte offset of the first new record within a region
        end = begin + n * rec
        start = self._tail_start()  # the tail block begins here: [start, begin) is kept in RAM
        full_end = end // blk * blk  # whole blocks [start, full_end) can now be written
        lead = begin - start
        if full_end <= start:  # the new records stay in the tail block: RAM only
            self._tails[:, lead : lead + n * rec].view(self.regions, n, rec)[:, :, :width] = records
            self.length += n
            return

        span = _round_up(end, blk) - start
        buf = self._staging(self.regions * span, keep=n > 1)
        staged = torch.frombuffer(buf, dtype=torch.uint8, count=self.regions * span).view(self.regions, span)
        staged[:, :lead] = self._tails[:, :lead]
        body = staged[:, lead : lead + n * rec].view(self.regions, n, rec)
        if width < rec:
            body.zero_()
        body[:, :, :width] = records
        staged[:, lead + n * rec :] = 0
        whole = full_end - start
        view = memoryview(buf)
        writes = [(view[r * span : r * span + whole], r * self.region_bytes + start) for r in range(self.regions)]
        if n > 1:
            self._write_now(writes)  # a prefill: its blocks are written before it returns
        else:  # a decode step filled a block: written behind, ahead of any later gather
            self._pending.append(self.threads.control.submit(self._write_now, writes, buf))
        if end > full_end:
            self._tails[:, : end - full_end] = staged[:, whole : whole + end - full_end]
        self.length += n

    def _append_one(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One position: its record goes into the tail block in RAM; a tail block it fills is
        handed, whole, to the I/O thread (written behind, ahead of any later gather)."""
        rec, blk, d = self.record_bytes, self.block_size, self.head_dim
        begin = self.length * rec
        lead = begin - self._tail_start()
        typed = self._tails[:, lead : lead + rec].view(self.dtype)  # [regions, rec / itemsize]
        typed[:, :d] = keys.detach().reshape(self.regions, d)
        typed[:, d : 2 * d] = values.detach().reshape(self.regions, d)
        self.length += 1
        if (begin + rec) % blk == 0:  # the tail block is full
            buf = _aligned(self.regions * blk)
            torch.frombuffer(buf, dtype=torch.uint8, count=self.regions * blk).view(self.regions, blk).copy_(
                self._tails
            )
            view = memoryview(buf)
            start = begin + rec - blk
            writes = [(view[r * blk : (r + 1) * blk], r * self.region_bytes + start) for r in range(self.regions)]
            self._pending.append(self.threads.control.submit(self._write_now, writes, buf))

    def _staging(self, need: int, keep: bool) -> mmap.mmap:
        """An aligned buffer for a write; a prefill's reuses the buffer its I/O threads keep
        (written before the next), a decode step's is its own (written later, behind the compute)."""
        if not keep or need > STAGE_KEEP:
            return _aligned(need)
        return self.threads.stage_buffer(max(need, self.regions * self.block_size))

    def _write_now(self, writes: list[tuple[memoryview, int]], keepalive=None) -> None:
        if len(writes) > 1 and len(writes[0][0]) >= (64 << 10) and self.threads.readers > 1:
            for f in [self.threads.io.submit(self._pwrite, b, off) for b, off in writes]:
                f.result()
        else:
            for b, off in writes:
                self._pwrite(b, off)
        self._drop_cache()

    def _raise_write_errors(self, wait: bool) -> None:
        """Report a failed background write and forget finished ones; `wait`: for all of them."""
        keep = []
        for f in self._pending:
            if not wait and not f.done():
                keep.append(f)
                continue
            exc = f.exception()
            if exc is not None:
                self._pending = []
                raise exc
        self._pending = keep

    def flush(self) -> None:
        """Wait for the blocks written behind; raise the first write error."""
        self._raise_write_errors(wait=True)

    # ------------------------------------------------------------------ reads
    def _plan(self, regions: np.ndarray, pos: np.ndarray):
        """Blocks holding the records, merged into runs. Returns (runs, record offsets in the
        read buffer, buffer bytes); runs are (first block, blocks, buffer block offset)."""
        rec, blk = self.record_bytes, self.block_size
        start = regions * self.region_bytes + pos * rec  # file offset of every record
        first = start // blk
        count = (start + rec - 1) // blk - first + 1
        if int(count.max()) == 1:
            blocks = first
        else:
            base = np.repeat(np.cumsum(count) - count, count)
            blocks = np.repeat(first, count) + (np.arange(int(count.sum())) - base)
        runs, _, nbytes = self._runs(np.unique(blocks))
        run_first, _, run_buf = runs
        which = np.searchsorted(run_first, first, side="right") - 1
        offsets = (run_buf[which] - run_first[which]) * blk + start
        return runs, offsets, nbytes

    def _merged(self, steps: np.ndarray) -> np.ndarray:
        """Whether a block `steps` blocks after the previous one read joins its run: the gap
        between them is at most `coalesce_gap_blocks` (the rule the C gather applies too)."""
        return steps <= self.coalesce_gap_blocks + 1

    def _runs(self, blocks: np.ndarray):
        """Sorted unique blocks merged into runs across gaps of at most `coalesce_gap_blocks`.
        Returns (runs, buffer byte offset of every block, buffer bytes)."""
        blk = self.block_size
        cut = np.nonzero(~self._merged(np.diff(blocks)))[0] + 1
        run_first = blocks[np.concatenate(([0], cut))]
        run_last = blocks[np.concatenate((cut - 1, [len(blocks) - 1]))]
        run_len = run_last - run_first + 1
        run_buf = np.cumsum(run_len) - run_len
        which = np.searchsorted(run_first, blocks, side="right") - 1
        where = (run_buf[which] + blocks - run_first[which]) * blk
        return (run_first, run_len, run_buf), where, int(run_len.sum()) * blk

    def _requests(self, runs, view: memoryview) -> list[tuple[memoryview, int]]:
        blk = self.block_size
        per = max(self.max_request_bytes // blk, 1)
        out = []
        for f, n, b in zip(*(r.tolist() for r in runs)):
            for i in range(0, n, per):
                m = min(per, n - i)
                out.append((view[(b + i) * blk : (b + i + m) * blk], (f + i) * blk))
        return out

    def _buffer(self, nbytes: int) -> mmap.mmap:
        """The read buffer of this tier's I/O threads, grown to `nbytes` (page aligned)."""
        return self.threads.read_buffer(nbytes)

    def _count(self, nbytes: int, disk_rows: int, ram_rows: int, seconds: float, reads: int = 0) -> None:
        useful = disk_rows * self.row_bytes
        cached = ram_rows * self.row_bytes
        self.stats.add(nbytes, disk_rows + ram_rows, seconds, useful_bytes=useful, cached_bytes=cached, reads=reads)
        self.bytes_read += nbytes  # a tier's reads run on one control thread: no lock needed
        self.bytes_useful += useful

    def _gather_async(self, indices, valid, device, dtype, out=None) -> Future:
        """The reads run on the control thread, so the caller can compute meanwhile; the result
        is counted when they complete."""
        self._check_open()
        self._raise_write_errors(wait=False)
        idx = indices.detach().to("cpu", torch.int64).clone()
        ok = valid.detach().to("cpu", torch.bool).clone()
        return self.threads.control.submit(self._gather, idx, ok, device, dtype, out, self.length)

    def _gather(self, indices: torch.Tensor, valid: torch.Tensor, device, dtype, out=None, length=None):
        t0 = time.perf_counter()
        d, rec = self.head_dim, self.record_bytes
        shape = (*indices.shape, d)
        flat = valid.nonzero(as_tuple=True)
        pos = indices[flat]
        m = int(pos.numel())
        rows = torch.empty(m, rec, dtype=torch.uint8)
        nbytes = reads = disk_rows = ram_rows = 0
        if m:
            region = (flat[0] * self.kv_heads + flat[1]).numpy()
            tail_pos = self._tail_start(length) // rec  # positions from here on are in the RAM tail
            nbytes, reads, disk_rows, ram_rows = self._read_records(region, pos.numpy(), tail_pos, rows)
        width = 2 * d * torch.empty((), dtype=self.dtype).element_size()
        kv = rows[:, :width].view(self.dtype)
        k, v = scatter_rows(flat, kv[:, :d], kv[:, d:], shape, device, dtype, out)
        self._count(nbytes, disk_rows, ram_rows, time.perf_counter() - t0, reads)
        return k, v

    def _read_records(self, region: np.ndarray, pos: np.ndarray, tail_pos: int, rows: torch.Tensor):
        """`_read_chunk` over rounds of rows whose blocks fit `read_chunk` bytes, so that the read
        buffer stays that size however large the batch and the context (one buffer the size of a
        whole layer's selection was up to a layer of KV kept with the compute). A round's bytes are
        counted as the gather reads them (`_round_costs`), and rounds split where a block starts:
        rows that share blocks (a page, a run) cost their blocks once, not a block each.
        Rows come sorted by file offset."""
        cost = self._round_costs(region, pos, tail_pos)
        cum = np.cumsum(cost)
        starts = np.flatnonzero(cost)  # the rows that open a block
        room = self.read_chunk - self.block_size  # a round's first row opens its first block
        total, first, m = (0, 0, 0, 0), 0, len(pos)
        while first < m:
            end = int(np.searchsorted(cum, cum[first] + room, side="right"))
            if end < m and cost[end] == 0:  # do not split a block: end the round where it starts
                opener = starts[np.searchsorted(starts, end, side="right") - 1] if len(starts) else 0
                end = int(opener) if opener > first else end
            end = max(end, first + 1)
            got = self._read_chunk(region[first:end], pos[first:end], tail_pos, rows[first:end])
            total, first = tuple(a + b for a, b in zip(total, got)), end
        return total

    def _round_costs(self, region: np.ndarray, pos: np.ndarray, tail_pos: int) -> np.ndarray:
        """The read buffer's bytes each row adds to a round that holds the rows before it, as the
        gather lays its reads out without a block cache (a cache only makes them fewer): a row that
        opens a block adds that block, and the blocks of the gap before it when the gap is short
        enough to be merged into the previous run; a row in the previous row's block, or in the
        RAM tail, adds nothing."""
        blk, gap = self.block_size, self.coalesce_gap_blocks
        cost = np.zeros(len(pos), dtype=np.int64)
        disk = np.flatnonzero(pos < tail_pos)
        if not len(disk):
            return cost
        if self.record_bytes > blk:  # records of whole blocks: each costs its blocks and a gap at most
            cost[disk] = self.record_bytes + gap * blk
            return cost
        block = (region[disk] * self.region_bytes + pos[disk] * self.record_bytes) // blk
        step = np.diff(block, prepend=-(gap + 2))  # the first opens a run of its own
        cost[disk] = np.where(step == 0, 0, np.where(self._merged(step), step, 1)) * blk
        return cost

    def _read_chunk(self, region: np.ndarray, pos: np.ndarray, tail_pos: int, rows: torch.Tensor):
        """The records of positions (region, pos), sorted by file offset, into rows [m, rec]:
        from the RAM tail, the block cache, or disk (the missing blocks merged into runs and
        read, then admitted to the cache). Returns (bytes read, reads, rows from disk, rows from RAM)."""
        lib = kernels.library() if self.record_bytes <= self.block_size else None
        if lib is None:
            return self._read_records_python(region, pos, tail_pos, rows)
        region = np.ascontiguousarray(region, dtype=np.int64)
        pos = np.ascontiguousarray(pos, dtype=np.int64)
        m = len(pos)
        work = np.empty(2 * m, dtype=np.int64)
        stats = np.zeros(5, dtype=np.int64)
        cache = self.cache
        self._drop_cache()
        while True:
            buf = self._buffer(0)
            rc = lib.ig_gather_rows(
                self._res.fd, self.block_size, self.region_bytes, self.record_bytes, m,
                region.ctypes.data, pos.ctypes.data, tail_pos, self._tails.data_ptr(),
                cache.data.data_ptr() if cache else None, cache.slots if cache else 0,
                cache.slot_of.ctypes.data if cache else None, cache.block_in.ctypes.data if cache else None,
                cache.ref.ctypes.data if cache else None, cache.hand.ctypes.data if cache else None,
                self.coalesce_gap_blocks, self.max_request_bytes, self._res.aio, self.threads.read_address,
                len(buf), work.ctypes.data, work[m:].ctypes.data, rows.data_ptr(), stats.ctypes.data,
            )  # fmt: skip
            if rc > 0:
                self._buffer(int(rc))  # grow the read buffer and try again
                continue
            if rc < 0:
                err = -int(rc)
                what = "short read from" if err == errno.EIO else "reading"
                raise KVStorageError(err, f"{what} a KV file in {self.directory} failed: {os.strerror(err)}")
            return int(stats[0]), int(stats[1]), int(stats[2]), int(stats[3])

    def _read_records_python(self, region: np.ndarray, pos: np.ndarray, tail_pos: int, rows: torch.Tensor):
        """`_read_records` without the C kernel: the same reads, the same cache policy."""
        rec, blk, cache = self.record_bytes, self.block_size, self.cache
        m = len(pos)
        in_tail = pos >= tail_pos
        if in_tail.any():
            t = np.nonzero(in_tail)[0]
            tails = self._tails.view(self.regions, -1, rec)
            rows[torch.from_numpy(t)] = tails[torch.from_numpy(region[t]), torch.from_numpy(pos[t] - tail_pos)]
        d = np.nonzero(~in_tail)[0]
        if not len(d):
            return 0, 0, 0, m
        if rec > blk:  # records span whole blocks (no cache then): plan them block by block
            runs, offsets, nbytes = self._plan(region[d], pos[d])
            buf = self._buffer(nbytes)
            reqs = self._requests(runs, memoryview(buf))
            self._drop_cache()
            self._read_many(reqs)
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
            rows[torch.from_numpy(d)] = raw.view(-1, rec)[torch.from_numpy(offsets // rec)]
            return nbytes, len(reqs), len(d), m - len(d)
        start = region[d] * self.region_bytes + pos[d] * rec
        blocks, which = np.unique(start // blk, return_inverse=True)
        slots = cache.slot_of[blocks] if cache is not None else np.full(len(blocks), -1, dtype=np.int64)
        hit = slots >= 0
        if cache is not None:
            cache.ref[slots[hit]] = PINNED
        nbytes, reads, where, buf = 0, 0, np.full(len(blocks), -1, dtype=np.int64), None
        if not hit.all():
            missing = np.nonzero(~hit)[0]
            runs, at, nbytes = self._runs(blocks[missing])
            where[missing] = at
            buf = self._buffer(nbytes)
            reqs = self._requests(runs, memoryview(buf))
            self._drop_cache()
            self._read_many(reqs)
            reads = len(reqs)
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(-1, blk)
            for j in missing if cache is not None else ():
                s = cache.victim()
                if s < 0:
                    break
                cache.place(int(blocks[j]), s)
                cache.data[s] = raw[where[j] // blk]
        inside = start % blk
        from_cache = hit[which]
        c, r = np.nonzero(from_cache)[0], np.nonzero(~from_cache)[0]
        if len(c):
            idx = (slots[which[c]] * blk + inside[c]) // rec
            rows[torch.from_numpy(d[c])] = cache.data.view(-1, rec)[torch.from_numpy(idx)]
        if len(r):
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
            idx = (where[which[r]] + inside[r]) // rec
            rows[torch.from_numpy(d[r])] = raw.view(-1, rec)[torch.from_numpy(idx)]
        if cache is not None:  # this gather's slots: used, no longer pinned
            cache.ref[slots[hit]] = USED
            placed = cache.slot_of[blocks[~hit]]
            cache.ref[placed[placed >= 0]] = USED
        return nbytes, reads, len(r), m - len(r)

    def _read_span(
        self, start: int, stop: int, out=None, device=None, dtype=None
    ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Positions [start, stop) of every region as [B, Hkv, stop - start, d] (into `out`, or
        new tensors of the stored dtype on the CPU), the bytes read from disk and the read
        requests: one sequential read per region for the whole blocks the span covers, in pieces
        of at most about `read_chunk` bytes (so the read buffer stays about that size whatever
        the span: a whole layer at a long context, a sliding window); the tail block comes from RAM."""
        self._check_open()
        if not 0 <= start <= stop <= self.length:
            raise IndexError(f"asked for positions [{start}, {stop}) but the tier holds {self.length}")
        d, n = self.head_dim, stop - start
        if n == 0:
            empty = torch.empty(self.batch, self.kv_heads, 0, d, dtype=self.dtype)
            return (*copy_prefix(empty, empty, device or "cpu", dtype or self.dtype, out), 0, 0)
        if out is not None:
            k, v = prefix_views(out, n)
        else:
            shape = (self.batch, self.kv_heads, n, d)
            k = torch.empty(shape, dtype=dtype or self.dtype, device=device or "cpu")
            v = torch.empty_like(k)
        flat_k, flat_v = k.view(self.regions, n, d), v.view(self.regions, n, d)  # views: written through
        piece = range_piece(self.read_chunk, self.block_size, self.record_bytes)
        nbytes = reads = 0
        # pieces end at multiples of `piece` (whole blocks), so no two read the same block
        edges = [start, *range((start // piece + 1) * piece, stop, piece), stop]
        for lo, hi in zip(edges, edges[1:]):
            got = self._read_piece(lo, hi, flat_k[:, lo - start : hi - start], flat_v[:, lo - start : hi - start])
            nbytes, reads = nbytes + got, reads + (self.regions if got else 0)
        return k, v, nbytes, reads

    def _read_piece(self, start: int, stop: int, flat_k: torch.Tensor, flat_v: torch.Tensor) -> int:
        """Positions [start, stop) of every region into flat_k, flat_v [regions, n, d]; the bytes
        read from disk."""
        d, rec, blk, n = self.head_dim, self.record_bytes, self.block_size, stop - start
        lo, hi = start * rec // blk * blk, _round_up(stop * rec, blk)  # the blocks the span touches
        span, tail = hi - lo, self._tail_start()
        on_disk = max(min(hi, tail) - lo, 0)  # whole blocks on disk; the rest is the RAM tail
        width = 2 * d * torch.empty((), dtype=self.dtype).element_size()
        first = start * rec - lo  # the span's first record within the blocks read
        group = max(self.read_chunk // span, 1)  # regions per read: the buffer stays about `read_chunk`
        for r0 in range(0, self.regions, group):
            r1 = min(r0 + group, self.regions)
            buf = self._buffer(span * (r1 - r0))
            view = memoryview(buf)
            if on_disk:
                self._drop_cache()
                reads = [
                    (view[(r - r0) * span : (r - r0) * span + on_disk], r * self.region_bytes + lo)
                    for r in range(r0, r1)
                ]
                self._read_many(reads)
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=span * (r1 - r0)).view(r1 - r0, span)
            if span > on_disk:
                raw[:, on_disk:span] = self._tails[r0:r1, lo + on_disk - tail : hi - tail]
            recs = raw[:, first : first + n * rec].reshape(r1 - r0, n, rec)[..., :width].view(self.dtype)
            flat_k[r0:r1].copy_(recs[..., :d])
            flat_v[r0:r1].copy_(recs[..., d:])
        return on_disk * self.regions

    def _read_range(self, start, stop, device, dtype, out=None):
        t0 = time.perf_counter()
        k, v, nbytes, reads = self._read_span(start, stop, out, device, dtype)
        tail_pos = self._tail_start() // self.record_bytes
        tail_rows = max(stop - max(start, tail_pos), 0)
        rows = stop - start
        self._count(
            nbytes, self.regions * (rows - tail_rows), self.regions * tail_rows, time.perf_counter() - t0, reads
        )
        return k, v

    def _read_range_async(self, start, stop, device, dtype, out=None) -> Future:
        """One sequential read per region on the control thread: full fetch issues it one layer
        ahead, a layer read in chunks one chunk ahead."""
        self._check_open()
        self._raise_write_errors(wait=False)
        return self.threads.control.submit(self._read_range, start, stop, device, dtype, out)

    def peek_all(self):
        self.flush()
        k, v, _, _ = self.threads.control.submit(self._read_span, 0, self.length).result()  # where the buffer is used
        return k, v

    # ------------------------------------------------------------------ reporting / lifetime
    def stored_bytes(self) -> int:
        """The file's allocated blocks (the positions reserved or reached, records padded)."""
        return self.regions * min(_round_up(self._allocated * self.record_bytes, self.block_size), self.region_bytes)

    def beside_compute(self) -> dict[str, int]:
        """RAM kept for the disk: the block cache's copies and its maps, the unwritten tails of
        the regions and the aligned staging and read buffers (reused by every write and gather)."""
        own = self._res.own_threads  # threads shared with other tiers are counted by their Storage
        out = {"tier_buffers": self._tails.nbytes + (own.nbytes if own is not None else 0)}
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
        return self._closed

    def close(self) -> None:
        """Wait for reads and writes in flight, then close the file, which frees it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for f in self._pending:  # blocks written behind: let them land before the file goes
            f.exception()
        self._pending = []
        if self._res.own_threads is not None:
            self._res.own_threads.shutdown(wait=True)
        self._finalizer()

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
