"""A disk tier's file: where it may go, the file itself, and the threads and buffers it is read with.

A KV file never has a name that outlives its process: it is created unnamed (``O_TMPFILE``) or,
where the file system refuses that, created and unlinked at once, so that nothing is left in the
directory however the process ends (``kill -9`` included); the kernel frees the blocks when the
descriptor closes. It is opened with ``O_DIRECT``, so that neither writes nor reads go through
the page cache, and every buffer handed to the kernel is page aligned (anonymous ``mmap``) and a
whole number of blocks long. The file is laid out for the tier's capacity but sparse: disk blocks
are allocated (``posix_fallocate``) for the positions the run is known to reach (``reserve``) and
grown on demand, so that a full disk is reported by the append that needs the room, as one
sentence, and never reaches a write behind the compute.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import infinigen.kernels as kernels
from infinigen.growing import grown_size
from infinigen.storage.base import KVStorageError
from infinigen.storage.layout import DiskLayout

ENV_DIR = "INFINIGEN_KV_DIR"
WHERE = f"kv_dir (--kv-dir, ${ENV_DIR})"  # how a user points the disk tier elsewhere
SPACE_MARGIN = 16  # the space check also asks for 1/SPACE_MARGIN of the KV bytes more, as headroom
READ_BUFFER_FLOOR = 1 << 16  # the read buffer is never smaller than this
AIO_DEPTH = 256  # reads one Linux AIO context keeps in flight at most


def default_directory() -> Path:
    """``$INFINIGEN_KV_DIR`` if set, else the system temporary directory."""
    return Path(os.environ.get(ENV_DIR) or tempfile.gettempdir())


def kv_directory(directory: str | os.PathLike | None) -> Path:
    """The directory a disk tier given `directory` (None: the default) puts its files in."""
    return Path(directory) if directory is not None else default_directory()


def check_space(directory: str | os.PathLike | None, nbytes: int) -> Path:
    """Fail early and clearly when `directory` cannot take `nbytes` of KV files (plus a margin of
    1/SPACE_MARGIN): a directory that does not exist, is not one, is read-only or not writable,
    or lacks the room. A missing directory is not created: a mistyped path must not quietly
    put the KV files on another disk. The storage factory calls it once, for every layer's
    reservation, before a generation writes anything; a tier made on its own calls it for its file."""
    d = kv_directory(directory)
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


def reserved_bytes(directory: str | os.PathLike | None, regions: int, row_bytes: int, positions: int) -> int:
    """Disk bytes a KV file of `regions` regions allocates for its first `positions` positions."""
    return DiskLayout.in_directory(kv_directory(directory), regions, row_bytes, positions).reserved_bytes(positions)


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


def aligned(nbytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned buffer (what O_DIRECT requires)."""
    return mmap.mmap(-1, max(nbytes, 1))


class IOThreads:
    """The threads disk tiers read with: one `control` thread runs each gather (plan, reads,
    unpacking) and `io` runs its reads, several in flight. Separate pools, so that a gather
    waiting for its reads can never starve them. One instance serves every layer of a cache.

    It also owns the aligned buffers the tiers read and stage writes in, one of each for every
    layer: reads run one at a time on the control thread, and a prefill's writes one layer at a
    time on the compute thread, so a buffer per tier would keep a layer's worth of KV next to the
    compute for every layer, for nothing."""

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
        """The read buffer, grown to `nbytes` (page aligned, doubling); only the control thread uses it."""
        if self._read is None or len(self._read) < nbytes:
            self._read = aligned(max(nbytes, 2 * len(self._read or b""), READ_BUFFER_FLOOR))
            self.read_address = ctypes.addressof(ctypes.c_char.from_buffer(self._read))
        return self._read

    @staticmethod
    def planned_read_buffer(nbytes: int) -> int:
        """The most the read buffer grows to when reads need at most `nbytes` at once."""
        return max(2 * nbytes, READ_BUFFER_FLOOR)

    def stage_buffer(self, nbytes: int) -> mmap.mmap:
        """The buffer a prefill's blocks are staged in before they are written (synchronously,
        on the compute thread), grown to `nbytes`."""
        if self._stage is None or len(self._stage) < nbytes:
            self._stage = aligned(nbytes)
        return self._stage

    @property
    def nbytes(self) -> int:
        return len(self._read or b"") + len(self._stage or b"")

    def shutdown(self, wait: bool = True) -> None:
        self.control.shutdown(wait=wait)
        self.io.shutdown(wait=wait)
        self._read = self._stage = None


class _Resources:
    """What must be released with the file; holds no reference to the file itself."""

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


class FileSpace:
    """The disk blocks of a KV file (`res.fd`): allocated for the first `reserve` positions of every
    region, grown on demand; a full disk is reported in one sentence."""

    def __init__(self, res: _Resources, layout: DiskLayout, directory: Path, reserve: int) -> None:
        self._res, self.layout, self.directory, self.reserved = res, layout, directory, reserve
        self.allocated = 0  # positions of every region with disk blocks allocated
        self._fallocate = hasattr(os, "posix_fallocate")

    def reserve(self, positions: int) -> None:
        """Disk blocks for the first `positions` of every region, allocated now so that a full
        disk fails here, on the caller's thread, with a sentence. Growing, it asks for a quarter
        more (`grown_size`) and settles for what is needed when the disk has no more. Where the
        file system cannot allocate ahead, the blocks come with the writes (errors likewise)."""
        if positions <= self.allocated:
            return
        capacity = self.layout.capacity
        target = grown_size(positions, positions, capacity) if self.allocated else max(positions, self.reserved)
        for want in dict.fromkeys((target, positions)):  # the roomy target, then just what is needed
            try:
                self._allocate_upto(want)
                return
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                    self._fallocate = False
                    self.allocated = target
                    return
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise KVStorageError(
                        e.errno, f"cannot allocate disk space for a KV file in {self.directory}: {e.strerror}"
                    ) from e
                if want == positions:
                    more = self.layout.regions * max(self._growth(positions), 0)
                    raise KVStorageError(e.errno, self.full(positions, more)) from e

    def _growth(self, positions: int) -> int:
        """Bytes of each region to allocate so that it holds its first `positions` positions."""
        return self.layout.allocated_bytes(positions) - self.layout.allocated_bytes(self.allocated)

    def _allocate_upto(self, positions: int) -> None:
        if self._fallocate:
            old, more = self.layout.allocated_bytes(self.allocated), self._growth(positions)
            for r in range(self.layout.regions):
                if more > 0:
                    os.posix_fallocate(self._res.fd, self.layout.at(r, old), more)
        self.allocated = positions

    def stored_bytes(self) -> int:
        """The file's allocated blocks (the positions reserved or reached, records padded)."""
        return self.layout.regions * self.layout.allocated_bytes(self.allocated)

    def full(self, positions: int, nbytes: int | None = None) -> str:
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


class DiskFile:
    """The unnamed file of one disk tier (see the module docstring): created, sized for the
    layout, its `space` allocated for `reserve` positions; its reads and writes, with their
    errors as sentences; released by `close()`, by garbage collection or when the process ends.

    `threads` are the I/O threads to read with; without them the file starts its own `readers`
    and stops them when it closes. Where the file system refuses O_DIRECT, a `KVStorageError`
    names the directory, unless `allow_buffered`: the file then goes through the page cache,
    which is dropped after every write and before every read (`direct` is False)."""

    def __init__(
        self,
        layout: DiskLayout,
        directory: Path,
        reserve: int,
        threads: IOThreads | None,
        readers: int,
        allow_buffered: bool,
    ) -> None:
        self.layout, self.directory = layout, directory
        self.closed = False
        self._res = _Resources()
        self.space = FileSpace(self._res, layout, directory, reserve)
        self._finalizer = weakref.finalize(self, _release, self._res)
        try:
            if threads is None:
                threads = self._res.own_threads = IOThreads(readers)
            self.threads = threads
            self.direct = self._open(allow_buffered)
            lib = kernels.library()
            if lib is not None:
                self._res.aio = int(lib.ig_aio_setup(AIO_DEPTH))  # 0 where AIO is unavailable: pread then
        except BaseException:
            self._finalizer()
            raise

    @property
    def fd(self) -> int:
        return self._res.fd

    @property
    def aio(self) -> int:
        return self._res.aio

    @property
    def owns_threads(self) -> bool:
        return self._res.own_threads is not None

    def _open(self, allow_buffered: bool) -> bool:
        """Create the unnamed file with O_DIRECT (True), or buffered if refused and allowed (False)."""
        direct_flag = getattr(os, "O_DIRECT", 0)
        reason = "this platform has no O_DIRECT"
        if direct_flag:
            try:
                self._res.fd = _create_unnamed(self.directory, direct_flag)
                self._size()
                buf = aligned(self.layout.block)  # some file systems accept O_DIRECT at open, refuse it at I/O
                self.pwrite(memoryview(buf), 0, 0)
                self.preadv(memoryview(buf), 0)
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
        self._size()
        return False

    def _size(self) -> None:
        """Size the file for the layout (sparse: no blocks yet) and allocate the reservation."""
        nbytes = self.layout.file_bytes
        try:
            os.ftruncate(self._res.fd, nbytes)
        except OSError as e:
            raise KVStorageError(
                e.errno, f"cannot size a KV file in {self.directory} to {nbytes} bytes: {e.strerror}"
            ) from e
        self.space.reserve(self.space.reserved)

    # ------------------------------------------------------------------ reads and writes
    def pwrite(self, buf: memoryview, offset: int, positions: int) -> None:
        """Write `buf` at `offset`; `positions`: what the write makes the tier hold (for a full disk's sentence)."""
        try:
            done = os.pwrite(self._res.fd, buf, offset)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise KVStorageError(e.errno, self.space.full(positions)) from e
            raise KVStorageError(e.errno, f"writing a KV file in {self.directory} failed: {e.strerror}") from e
        if done != len(buf):
            raise KVStorageError(
                errno.EIO,
                f"short write to a KV file in {self.directory}: {done} of {len(buf)} bytes at offset {offset}",
            )

    def preadv(self, buf: memoryview, offset: int) -> None:
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

    def drop_cache(self) -> None:
        """Without O_DIRECT, forget the page cache's copy so that the next read comes from disk."""
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._res.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read_many(self, requests: list[tuple[memoryview, int]]) -> None:
        """Issue (buffer, offset) reads, up to `threads.readers` in flight."""
        if not requests:
            return
        readers = self.threads.readers
        if len(requests) == 1 or readers == 1:
            for buf, off in requests:
                self.preadv(buf, off)
            return
        parts = min(readers, len(requests))

        def run(chunk):
            for buf, off in chunk:
                self.preadv(buf, off)

        futures = [self.threads.io.submit(run, requests[i::parts]) for i in range(parts)]
        for f in futures:
            f.result()

    def write_many(self, writes: list[tuple[memoryview, int]], positions: int) -> None:
        """Write (buffer, offset) pairs, large ones several at a time; then drop the page cache."""
        if len(writes) > 1 and len(writes[0][0]) >= (64 << 10) and self.threads.readers > 1:
            for f in [self.threads.io.submit(self.pwrite, b, off, positions) for b, off in writes]:
                f.result()
        else:
            for b, off in writes:
                self.pwrite(b, off, positions)
        self.drop_cache()

    # ------------------------------------------------------------------ lifetime
    def check_open(self) -> None:
        if self.closed or self._res.fd < 0:
            raise ValueError(f"this disk KV tier (in {self.directory}) is closed")

    def close(self) -> None:
        """Stop the file's own threads, then close it, which frees its blocks (idempotent)."""
        self.closed = True
        if self._res.own_threads is not None:
            self._res.own_threads.shutdown(wait=True)
        self._finalizer()
