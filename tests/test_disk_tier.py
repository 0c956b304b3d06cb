"""The disk tier: bit-identical to RAM, coalesced reads counted honestly, files that never
outlive their tier, space reserved and grown as needed, clear errors for space, directories
and short I/O."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import shutil
import tempfile
from collections import namedtuple
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import open_files_in
from infinigen.storage import DiskTier, KVCapacityError, KVStorageError, RamTier, TransferStats
from infinigen.storage.base import KVIndexError

B, H, D = 2, 3, 64
PREFILL, DECODE = 300, 20
CAPACITY = 400


def _direct_ok(directory: Path) -> bool:
    """Can a file in `directory` be written and read back with O_DIRECT?"""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd0, path = tempfile.mkstemp(dir=directory)
    except OSError:
        return False
    os.close(fd0)
    try:
        fd = os.open(path, os.O_RDWR | flag)
        try:
            buf = mmap.mmap(-1, 4096)
            return os.pwrite(fd, buf, 0) == 4096 and os.preadv(fd, [buf], 0) == 4096
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        os.unlink(path)


@pytest.fixture
def kv_dir(tmp_path):
    """Keyword arguments (directory, allow_buffered) for a private directory where O_DIRECT
    works if any candidate supports it; otherwise tmp_path in buffered mode."""
    candidates = [tmp_path, Path("/var/tmp"), Path(__file__).resolve().parents[1] / ".pytest_kv"]
    for base in candidates:
        if base == tmp_path:
            if _direct_ok(base):
                yield {"directory": base, "allow_buffered": False}
                return
            continue
        try:
            base.mkdir(parents=True, exist_ok=True)
            private = Path(tempfile.mkdtemp(prefix="kvtest-", dir=base))
        except OSError:
            continue
        if _direct_ok(private):
            try:
                yield {"directory": private, "allow_buffered": False}
            finally:
                shutil.rmtree(private, ignore_errors=True)
            return
        shutil.rmtree(private, ignore_errors=True)
    yield {"directory": tmp_path, "allow_buffered": True}


@pytest.fixture(params=["c", "python"])
def gather_path(request, monkeypatch):
    """Every read test runs on the C gather and on the Python one (its fallback and reference)."""
    from infinigen import kernels

    if request.param == "python":
        monkeypatch.setenv("INFINIGEN_KERNELS", "0")
    elif not kernels.available():
        if os.environ.get("CI"):
            pytest.fail("the C gather must build on CI (a C compiler is installed)")
        pytest.skip("no C compiler here")
    return request.param


def _pair(kv_dir, dtype=torch.float16, b=B, h=H, d=D, capacity=CAPACITY, **kw):
    ram = RamTier(b, h, d, dtype, TransferStats())
    disk = DiskTier(b, h, d, dtype, TransferStats(), capacity=capacity, **kv_dir, **kw)
    return ram, disk


def _append_both(ram, disk, n, gen):
    b, h, d = ram.batch, ram.kv_heads, ram.head_dim
    k = torch.randn(b, h, n, d, generator=gen)
    v = torch.randn(b, h, n, d, generator=gen)
    ram.append(k, v)
    disk.append(k, v)


def _selection(b, h, n, length, gen, p_valid=0.8):
    """Ascending positions among valid slots, padding slots hold 0."""
    idx = torch.stack([torch.randperm(length, generator=gen)[:n] for _ in range(b * h)]).view(b, h, n)
    valid = torch.rand(b, h, n, generator=gen) < p_valid
    big = torch.full_like(idx, length)
    idx = torch.where(valid, idx, big).sort(-1).values
    valid = idx < length
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize(
    "dtype,d",
    [(torch.float16, 64), (torch.float32, 64), (torch.bfloat16, 64), (torch.float16, 40)],
    ids=["fp16", "fp32", "bf16", "fp16-d40-straddling"],
)
@pytest.mark.parametrize("cache", [0.0, 0.3])
def test_bit_identical_to_ram(kv_dir, dtype, d, cache, gather_path):
    gen = torch.Generator().manual_seed(0)
    ram, disk = _pair(kv_dir, dtype, d=d, cache_fraction=cache)
    with disk:
        _append_both(ram, disk, PREFILL, gen)
        for step in range(DECODE):
            _append_both(ram, disk, 1, gen)
            if step % 5 == 0:
                for out in (dtype, torch.float32):
                    idx, valid = _selection(B, H, 40, ram.length, gen)
                    kr, vr = ram.gather(idx, valid, torch.device("cpu"), out)
                    kd, vd = disk.gather(idx, valid, torch.device("cpu"), out)
                    assert kd.dtype == out and kd.shape == (B, H, 40, d)
                    assert torch.equal(kr, kd) and torch.equal(vr, vd)
                    assert not kd[~valid].any() and not vd[~valid].any()
        assert disk.length == ram.length == PREFILL + DECODE
        for upto in (0, 1, 17, PREFILL, ram.length):
            kr, vr = ram.read_all(upto, torch.device("cpu"), torch.float32)
            kd, vd = disk.read_all(upto, torch.device("cpu"), torch.float32)
            assert torch.equal(kr, kd) and torch.equal(vr, vd)
        # Ranges: inside one block, across blocks, from mid-block, into and wholly within the tail.
        n = ram.length
        for start, stop in ((0, 0), (5, 9), (3, 40), (17, PREFILL), (PREFILL - 2, n), (n - 1, n), (n, n)):
            kr, vr = ram.read_range_async(start, stop, torch.device("cpu"), torch.float32).result()
            kd, vd = disk.read_range_async(start, stop, torch.device("cpu"), torch.float32).result()
            assert kd.shape == (B, H, stop - start, d)
            assert torch.equal(kr, kd) and torch.equal(vr, vd)
            assert torch.equal(kd, disk.peek_all()[0][:, :, start:stop].float())
        kr, vr = ram.peek_all()
        kd, vd = disk.peek_all()
        assert kd.dtype == dtype and torch.equal(kr, kd) and torch.equal(vr, vd)
        # Everything selected, nothing valid, all edge positions.
        full = torch.arange(ram.length).expand(B, H, -1).contiguous()
        for valid in (torch.ones_like(full, dtype=torch.bool), torch.zeros_like(full, dtype=torch.bool)):
            kr, vr = ram.gather(full, valid, torch.device("cpu"), dtype)
            kd, vd = disk.gather(full, valid, torch.device("cpu"), dtype)
            assert torch.equal(kr, kd) and torch.equal(vr, vd)


def test_decode_appends_write_whole_blocks_behind(kv_dir, monkeypatch):
    """A decode step only fills the RAM tail; a full block is written once, by the I/O thread;
    the tail's rows are served from RAM (cached bytes), equal to the RAM tier's."""
    gen = torch.Generator().manual_seed(1)
    ram, disk = _pair(kv_dir)
    with disk:
        _append_both(ram, disk, PREFILL, gen)
        writes = []
        real = os.pwrite

        def counting(fd, buf, off):
            writes.append((len(buf), off % disk.block_size))
            return real(fd, buf, off)

        monkeypatch.setattr(os, "pwrite", counting)
        per_block = disk.block_size // disk.record_bytes
        to_fill = per_block - PREFILL % per_block
        for _ in range(to_fill - 1):
            _append_both(ram, disk, 1, gen)
        disk.flush()
        assert writes == []  # still a partial block: RAM only

        disk.stats.reset()
        recent = torch.arange(disk.length - 3, disk.length).expand(B, H, 3).contiguous()
        ok = torch.ones_like(recent, dtype=torch.bool)
        kd, vd = disk.gather(recent, ok, torch.device("cpu"), torch.float32)
        kr, vr = ram.gather(recent, ok, torch.device("cpu"), torch.float32)
        assert torch.equal(kd, kr) and torch.equal(vd, vr)
        assert disk.stats.cached_bytes == disk.stats.bytes == B * H * 3 * disk.row_bytes  # nothing from disk

        _append_both(ram, disk, 1, gen)  # fills the block
        disk.flush()
        assert writes == [(disk.block_size, 0)] * (B * H)
        writes.clear()
        _append_both(ram, disk, 50, gen)  # a chunk: one write per region, before it returns
        assert len(writes) == B * H
        assert torch.equal(ram.peek_all()[0], disk.peek_all()[0])


def test_coalescing_and_counting(kv_dir, gather_path):
    gen = torch.Generator().manual_seed(2)
    ram, disk = _pair(kv_dir)  # fp16, d=64: 256-byte records, 16 per 4 KiB block; no block cache
    rec, blk = disk.record_bytes, disk.block_size
    assert rec == 256
    with disk:
        _append_both(ram, disk, PREFILL + DECODE, gen)
        n = disk.length
        on_disk = n // (blk // rec) * (blk // rec)  # the partial tail block is served from RAM

        def select(positions, b=0, h=1):
            idx = torch.zeros(B, H, len(positions), dtype=torch.long)
            valid = torch.zeros(B, H, len(positions), dtype=torch.bool)
            idx[b, h] = torch.tensor(positions)
            valid[b, h] = True
            return idx, valid

        # Every position of one region: exactly the blocks holding it, amplification 1.
        disk.stats.reset()
        before_read, before_useful = disk.bytes_read, disk.bytes_useful
        disk.gather(*select(list(range(n))), torch.device("cpu"), torch.float16)
        expect = on_disk * rec
        assert disk.stats.bytes - disk.stats.cached_bytes == expect
        assert disk.stats.cached_bytes == (n - on_disk) * rec
        assert disk.stats.rows == n
        assert disk.bytes_useful - before_useful == on_disk * rec
        assert disk.bytes_read - before_read == expect
        assert disk.stats.reads == 1  # one contiguous run, one request

        # Scattered: one row every 4 blocks (gap of 3 > coalesce_gap_blocks=2) -> one block each.
        disk.stats.reset()
        before_read, before_useful = disk.bytes_read, disk.bytes_useful
        pos = list(range(0, on_disk, 64))
        disk.gather(*select(pos), torch.device("cpu"), torch.float16)
        assert disk.stats.bytes == len(pos) * blk
        assert disk.stats.reads == len(pos)
        amp = (disk.bytes_read - before_read) / (disk.bytes_useful - before_useful)
        assert amp == blk / rec > 1

        # One row every 2 blocks (gap of 1): merged into a single run including the gaps.
        disk.stats.reset()
        pos = list(range(0, on_disk, 32))
        disk.gather(*select(pos), torch.device("cpu"), torch.float16)
        assert disk.stats.bytes == ((pos[-1] * rec) // blk + 1) * blk
        assert disk.stats.reads == 1

        # read_all: one sequential read per region, counted exactly.
        disk.stats.reset()
        disk.read_all(n, torch.device("cpu"), torch.float16)
        assert disk.stats.reads == B * H
        assert disk.stats.bytes - disk.stats.cached_bytes == B * H * expect
        assert disk.stats.rows == B * H * n

        # peek_all reads but does not count.
        disk.stats.reset()
        disk.peek_all()
        assert disk.stats.bytes == disk.stats.requests == 0
        assert disk.read_amplification > 1


def test_block_cache_serves_repeated_blocks_from_ram(kv_dir, gather_path):
    """A block read once is served from RAM next time; the cache never holds more than its
    slots; rows stay identical to the RAM tier's however the cache turns over."""
    gen = torch.Generator().manual_seed(7)
    ram, disk = _pair(kv_dir, cache_fraction=0.25)
    with disk:
        _append_both(ram, disk, PREFILL + DECODE, gen)
        slots = disk.cache.slots
        assert slots == -(-disk.file_bytes // disk.block_size // 4)
        idx, valid = _selection(B, H, 5, 256, gen, p_valid=1.0)  # on disk, and at most 30 blocks: they all fit
        disk.stats.reset()
        first = disk.gather(idx, valid, torch.device("cpu"), torch.float32)
        assert disk.stats.cached_bytes == 0 and disk.stats.reads > 0
        disk.stats.reset()
        again = disk.gather(idx, valid, torch.device("cpu"), torch.float32)
        assert disk.stats.reads == 0 and disk.stats.bytes == disk.stats.cached_bytes == B * H * 5 * disk.row_bytes
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
        for _ in range(12):  # selections that overflow the cache: it turns over, rows stay right
            idx, valid = _selection(B, H, 120, disk.length, gen)
            kd, vd = disk.gather(idx, valid, torch.device("cpu"), torch.float32)
            kr, vr = ram.gather(idx, valid, torch.device("cpu"), torch.float32)
            assert torch.equal(kd, kr) and torch.equal(vd, vr)
            assert (disk.cache.block_in >= 0).sum() <= slots


def test_the_layout_places_every_record_once_and_never_across_a_block():
    """`DiskLayout` is the one place the file's offsets are computed: records of one region
    follow each other, regions start on block boundaries, no record straddles a block, and the
    RAM tail holds the records after the last whole block."""
    from infinigen.storage.layout import DiskLayout

    lay = DiskLayout(regions=3, row_bytes=200, block=4096, capacity=40)
    assert lay.record == 256 and lay.region_bytes == 3 * 4096 and lay.file_bytes == 9 * 4096
    region, pos = np.repeat(np.arange(3), 40), np.tile(np.arange(40), 3)
    offsets = lay.offsets(region, pos)
    assert len(set(offsets.tolist())) == 120 and (offsets % lay.record == 0).all()
    assert (offsets // lay.block == (offsets + lay.record - 1) // lay.block).all()
    assert lay.offsets(2, 0) == 2 * lay.region_bytes and lay.offsets(1, 3) == lay.region_bytes + 3 * 256
    assert lay.tail_start(20) == 4096 and lay.tail_position(20) == 16
    tail = lay.tail_offsets(region, pos, 20)
    assert (tail[pos < 16] == -1).all()
    assert (tail[pos >= 16] == (region * 4096 + (pos - 16) * 256)[pos >= 16]).all()
    assert lay.span(3, 17) == (0, 2 * 4096) and lay.range_piece(3 * 4096) == 32
    wide = DiskLayout(regions=2, row_bytes=5000, block=4096, capacity=4)  # records of whole blocks
    assert wide.whole_blocks and wide.record == 8192 and wide.tail_start(3) == 3 * 8192


def test_c_and_python_gathers_read_the_same_bytes(kv_dir, monkeypatch):
    """Same rows, same bytes, same reads and the same cache state, step after step."""
    from infinigen import kernels

    if not kernels.available():
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(8)
    tiers = []
    for _ in range(2):
        _, disk = _pair(kv_dir, cache_fraction=0.2)
        gen_data = torch.Generator().manual_seed(9)
        _append_both(RamTier(B, H, D, torch.float16, TransferStats()), disk, PREFILL, gen_data)
        tiers.append(disk)
    try:
        for _ in range(10):
            idx, valid = _selection(B, H, 60, PREFILL, gen)
            out = []
            for path, disk in zip(("c", "python"), tiers):
                monkeypatch.setenv("INFINIGEN_KERNELS", "1" if path == "c" else "0")
                disk.stats.reset()
                out.append(
                    (disk.gather(idx, valid, torch.device("cpu"), torch.float16), disk.stats.bytes, disk.stats.reads)
                )
            (kc, vc), bc, rc = out[0]
            (kp, vp), bp, rp = out[1]
            assert torch.equal(kc, kp) and torch.equal(vc, vp) and bc == bp and rc == rp
            a, b = tiers[0].cache, tiers[1].cache
            assert np.array_equal(a.slot_of, b.slot_of) and np.array_equal(a.ref, b.ref) and a.hand[0] == b.hand[0]
    finally:
        for disk in tiers:
            disk.close()


def test_gather_async_returns_future_equal_to_gather(kv_dir):
    gen = torch.Generator().manual_seed(3)
    ram, disk = _pair(kv_dir)
    with disk:
        _append_both(ram, disk, PREFILL, gen)
        idx, valid = _selection(B, H, 64, disk.length, gen)
        requests, nbytes = disk.stats.requests, disk.stats.bytes
        fut = disk.gather_async(idx, valid, torch.device("cpu"), torch.float32)
        assert isinstance(fut, Future)
        ka, va = fut.result(timeout=30)
        assert disk.stats.requests == requests + 1  # the future's work is counted once
        once = disk.stats.bytes - nbytes
        assert once > 0
        kg, vg = disk.gather(idx, valid, torch.device("cpu"), torch.float32)
        assert torch.equal(ka, kg) and torch.equal(va, vg)
        assert disk.stats.requests == requests + 2 and disk.stats.bytes - nbytes == 2 * once
        kr, _ = ram.gather(idx, valid, torch.device("cpu"), torch.float32)
        assert torch.equal(ka, kr)


def test_files_have_no_name_and_are_released_however_the_tier_ends(kv_dir):
    """Nothing a crash could leave behind: the directory never lists a KV file; each tier holds
    its own file open, and closing, garbage collection or leaving a `with` block releases it."""
    directory = kv_dir["directory"]
    stats = TransferStats()
    a = DiskTier(1, 1, 64, torch.float16, stats, capacity=64, **kv_dir)
    b = DiskTier(1, 1, 64, torch.float16, stats, capacity=64, **kv_dir)
    assert _files(directory) == []
    assert len(open_files_in(directory)) == 2
    if not kv_dir["allow_buffered"]:
        assert a.direct and b.direct
    a.append(torch.ones(1, 1, 20, 64), torch.ones(1, 1, 20, 64))
    b.append(torch.full((1, 1, 20, 64), 2.0), torch.full((1, 1, 20, 64), 2.0))
    assert (a.peek_all()[0] == 1).all() and (b.peek_all()[0] == 2).all()  # two distinct files

    a.close()
    a.close()  # idempotent
    assert len(open_files_in(directory)) == 1
    with pytest.raises(ValueError, match="closed"):
        a.append(torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64))

    del b
    gc.collect()
    assert open_files_in(directory) == []

    with pytest.raises(RuntimeError, match="boom"):
        with DiskTier(1, 1, 64, torch.float16, stats, capacity=64, **kv_dir) as c:
            c.append(torch.zeros(1, 1, 3, 64), torch.zeros(1, 1, 3, 64))
            assert len(open_files_in(directory)) == 1
            raise RuntimeError("boom")
    assert open_files_in(directory) == [] and _files(directory) == []


def test_default_directory_from_environment(kv_dir, monkeypatch):
    monkeypatch.setenv("INFINIGEN_KV_DIR", str(kv_dir["directory"]))
    with DiskTier(1, 2, 64, torch.float16, TransferStats(), capacity=10, allow_buffered=kv_dir["allow_buffered"]) as t:
        (held,) = open_files_in(kv_dir["directory"])
        assert t.directory == Path(kv_dir["directory"])
        assert t.region_bytes == t.block_size  # 10 * 256 bytes padded to one block
        assert os.stat(held).st_size == 2 * t.block_size


def _allocated(directory) -> int:
    (held,) = open_files_in(directory)
    return os.stat(held).st_blocks * 512


def _about(got: int, blocks: int, block: int) -> bool:
    """`blocks` data blocks, give or take the file system's own metadata (an extent block or two)."""
    return blocks * block <= got <= (blocks + 4) * block


def test_space_is_reserved_up_front_and_grown_on_demand(kv_dir):
    """The file is laid out for `capacity` but holds disk blocks only for `reserve` positions,
    grown (by a quarter, at least 64 positions) as appends need more, never beyond capacity."""
    directory = kv_dir["directory"]
    gen = torch.Generator().manual_seed(7)
    ram = RamTier(B, H, D, torch.float16, TransferStats())
    with DiskTier(B, H, D, torch.float16, TransferStats(), capacity=4096, reserve=32, **kv_dir) as disk:
        blk = disk.block_size
        assert disk.file_bytes == B * H * 4096 * 256
        if _allocated(directory) >= disk.file_bytes:
            pytest.skip("this file system allocates sparse files in full")
        assert _about(_allocated(directory), B * H * 2, blk)  # 32 positions of 256 B: 2 blocks per region
        _append_both(ram, disk, 40, gen)  # past the reserve: grown to 40 + 64 positions, 7 blocks
        assert _about(_allocated(directory), B * H * 7, blk)
        for _ in range(70):
            _append_both(ram, disk, 1, gen)
        disk.flush()
        assert _about(_allocated(directory), B * H * 11, blk)  # grown at 105: 169 positions, 11 blocks
        assert torch.equal(ram.peek_all()[0], disk.peek_all()[0])
    with DiskTier(B, H, D, torch.float16, TransferStats(), capacity=100, reserve=10**6, **kv_dir) as disk:
        assert _about(_allocated(directory), disk.file_bytes // disk.block_size, disk.block_size)


def test_not_enough_space_fails_before_creating_a_file(kv_dir, monkeypatch):
    directory = kv_dir["directory"]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10_000, 9_000, 1_000))
    with pytest.raises(KVStorageError, match="not enough free space") as info:
        DiskTier(B, H, D, torch.float16, TransferStats(), capacity=CAPACITY, **kv_dir)
    msg = str(info.value)
    assert str(directory) in msg and "1000 free" in msg
    assert f"needs {B * H * 25 * 4096} bytes" in msg  # 400 * 256 B = 25 blocks per region
    assert "\n" not in msg and not msg.startswith("[Errno")
    assert info.value.errno == errno.ENOSPC
    assert _files(directory) == []


def test_unusable_directory_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    bad = tmp_path / "file" / "sub"
    with pytest.raises(KVStorageError, match=str(bad)):
        DiskTier(1, 1, 64, torch.float16, TransferStats(), capacity=16, directory=bad)
    assert _files(tmp_path) == ["file"]


def test_refused_o_direct_names_directory_or_falls_back(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real = os.open

    def refusing(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises(KVStorageError, match=f"{tmp_path}.*refuses O_DIRECT.*allow_buffered"):
        DiskTier(1, 1, 64, torch.float16, TransferStats(), capacity=16, directory=tmp_path)
    assert _files(tmp_path) == []

    gen = torch.Generator().manual_seed(4)
    ram, disk = _pair({"directory": tmp_path}, allow_buffered=True)
    with disk:
        assert disk.direct is False
        _append_both(ram, disk, 50, gen)
        _append_both(ram, disk, 1, gen)
        idx, valid = _selection(B, H, 10, ram.length, gen)
        assert torch.equal(
            ram.gather(idx, valid, torch.device("cpu"), torch.float16)[1],
            disk.gather(idx, valid, torch.device("cpu"), torch.float16)[1],
        )
    assert _files(tmp_path) == []


def test_short_read_and_write_raise(kv_dir, monkeypatch):
    monkeypatch.setenv("INFINIGEN_KERNELS", "0")  # reads through os.preadv, which this test shortens
    gen = torch.Generator().manual_seed(5)
    ram, disk = _pair(kv_dir)
    with disk:
        _append_both(ram, disk, 40, gen)
        real_read = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: max(real_read(fd, bufs, off) - 512, 0))
        idx, valid = _selection(B, H, 8, disk.length, gen)
        with pytest.raises(KVStorageError, match="short read"):
            disk.gather(idx, valid, torch.device("cpu"), torch.float16)
        with pytest.raises(KVStorageError, match="short read"):
            disk.gather_async(idx, valid, torch.device("cpu"), torch.float16).result()
        with pytest.raises(KVStorageError, match="short read"):
            disk.read_all(disk.length, torch.device("cpu"), torch.float16)
        monkeypatch.setattr(os, "preadv", real_read)

        real_write = os.pwrite
        monkeypatch.setattr(os, "pwrite", lambda fd, buf, off: real_write(fd, buf, off) - 512)
        with pytest.raises(KVStorageError, match="short write"):
            _append_both(ram, disk, 30, gen)  # a chunk writes before it returns
        # A decode step's block is written behind: its failure is reported by the next call.
        per_block = disk.block_size // disk.record_bytes
        with pytest.raises(KVStorageError, match="short write"):
            for _ in range(per_block + 1):
                disk.append(torch.zeros(B, H, 1, D), torch.zeros(B, H, 1, D))
            disk.flush()


def test_capacity_and_bad_selections(kv_dir):
    gen = torch.Generator().manual_seed(6)
    ram, disk = _pair(kv_dir, capacity=32)
    with disk:
        _append_both(ram, disk, 30, gen)
        with pytest.raises(KVCapacityError, match="sized for 32 positions"):
            disk.append(torch.zeros(B, H, 3, D), torch.zeros(B, H, 3, D))
        assert disk.length == 30
        _append_both(ram, disk, 2, gen)  # exactly full is fine
        assert torch.equal(ram.peek_all()[0], disk.peek_all()[0])
        idx = torch.full((B, H, 1), 32)
        with pytest.raises(IndexError, match="selected position 32 but the tier holds 32"):
            disk.gather(idx, torch.ones_like(idx, dtype=torch.bool), torch.device("cpu"), torch.float16)
        with pytest.raises(ValueError, match="tier holds"):
            disk.append(torch.zeros(B, H + 1, 1, D), torch.zeros(B, H + 1, 1, D))


@pytest.mark.parametrize("cache", [0.0, 0.3])
def test_a_large_gather_reads_in_bounded_chunks_and_is_still_bit_identical(kv_dir, gather_path, cache, monkeypatch):
    """A gather of many regions is read a few regions at a time through one buffer of about
    READ_CHUNK bytes (not one buffer as large as the layer's selection), with the same rows as one
    read of everything and no more bytes."""
    import infinigen.storage.disk as disk_module

    gen = torch.Generator().manual_seed(4)
    b, h = 4, 3
    results = []
    for chunk in (1 << 30, CAPACITY * 2 * D * 2):  # everything at once, then one region's blocks at a time
        monkeypatch.setattr(disk_module, "READ_CHUNK", chunk)
        gen.manual_seed(4)
        ram, disk = _pair(kv_dir, b=b, h=h, cache_fraction=cache)
        with disk:
            _append_both(ram, disk, PREFILL, gen)
            idx, valid = _selection(b, h, 60, ram.length, gen)
            kr, vr = ram.gather(idx, valid, torch.device("cpu"), torch.float32)
            kd, vd = disk.gather(idx, valid, torch.device("cpu"), torch.float32)
            assert torch.equal(kr, kd) and torch.equal(vr, vd)
            results.append((disk.stats.bytes, disk.stats.rows, disk.threads.nbytes))
    (bytes_all, rows_all, buffer_all), (bytes_chunked, rows_chunked, buffer_chunked) = results
    assert rows_all == rows_chunked
    assert bytes_chunked <= bytes_all  # rounds end where blocks start; a gap between them is not read
    assert buffer_chunked < buffer_all


def _counting(read_round, calls: list[tuple[int, int]]):
    """`read_round`, noting the rows and the bytes each call reads."""

    def counted(offsets, tail_at, rows):
        got = read_round(offsets, tail_at, rows)
        calls.append((len(offsets), got[0]))
        return got

    return counted


@pytest.mark.parametrize("cache", [0.0, 0.3])
def test_rounds_of_reads_hold_their_blocks_within_read_chunk(kv_dir, gather_path, cache, monkeypatch):
    """A gather reads in rounds of at most `read_chunk` bytes of blocks, counted as read: rows that
    share blocks (pages of 16 rows here) cost their blocks once, so a selection of whole pages
    takes a round per `read_chunk` of pages, and a scattered one a round per few rows; every row
    is the RAM tier's."""
    gen = torch.Generator().manual_seed(5)
    chunk = 4 * 4096  # four blocks, 64 positions of 256 bytes
    for pages in (True, False):
        gen.manual_seed(5)
        ram, disk = _pair(kv_dir, b=1, h=1, cache_fraction=cache, read_chunk=chunk)
        with disk:
            _append_both(ram, disk, PREFILL, gen)  # 300 positions: 18 whole blocks on disk, the tail in RAM
            calls: list[tuple[int, int]] = []
            monkeypatch.setattr(disk.reader, "_round", _counting(disk.reader._round, calls))
            if pages:  # blocks 0-3 and 10-13, whole: two rounds of four blocks
                pos = torch.cat([torch.arange(0, 64), torch.arange(160, 224)]).view(1, 1, -1)
                idx, valid = pos, torch.ones_like(pos, dtype=torch.bool)
            else:
                idx, valid = _selection(1, 1, 60, ram.length, gen, p_valid=1.0)
            kr, vr = ram.gather(idx, valid, torch.device("cpu"), torch.float32)
            kd, vd = disk.gather(idx, valid, torch.device("cpu"), torch.float32)
            assert torch.equal(kr, kd) and torch.equal(vr, vd)
            assert sum(rows for rows, _ in calls) == int(valid.sum())
            assert all(nbytes <= chunk for _, nbytes in calls), calls
            if pages:
                assert [rows for rows, _ in calls] == [64, 64]
                assert disk.stats.bytes == 8 * 4096
            else:
                assert len(calls) >= disk.stats.bytes // chunk


def test_a_range_reads_the_blocks_it_covers_once_per_region(kv_dir):
    """A chunk of a layer read in chunks costs one sequential read per region of exactly the
    whole blocks its positions touch (the RAM tail apart), not a gather's scattered reads."""
    gen = torch.Generator().manual_seed(8)
    ram, disk = _pair(kv_dir, b=2, h=3)
    with disk:
        _append_both(ram, disk, PREFILL, gen)
        per_block = disk.block_size // disk.record_bytes
        on_disk = disk.length // per_block * per_block  # positions in whole blocks on disk
        for start, stop in ((0, 1), (per_block - 1, per_block + 1), (3, on_disk), (per_block, 3 * per_block)):
            disk.stats.reset()
            kd, vd = disk.read_range_async(start, stop, torch.device("cpu"), torch.float32).result()
            kr, vr = ram.read_range_async(start, stop, torch.device("cpu"), torch.float32).result()
            assert torch.equal(kr, kd) and torch.equal(vr, vd)
            blocks = -(-stop // per_block) - start // per_block
            assert disk.stats.bytes == 2 * 3 * blocks * disk.block_size
            assert disk.stats.reads == 2 * 3
            assert disk.stats.rows == 2 * 3 * (stop - start)
        with pytest.raises(KVIndexError, match="holds"):
            disk.read_range_async(5, disk.length + 1, torch.device("cpu"), torch.float32)
        with pytest.raises(KVIndexError, match="holds"):
            disk.read_range_async(6, 5, torch.device("cpu"), torch.float32)


def test_a_range_longer_than_a_round_is_read_in_pieces_of_at_most_a_round(kv_dir):
    """A sliding window, or a whole layer at a long context, spans more blocks per region than a
    round of reads holds: it is read in pieces of at most `read_chunk` bytes, the same rows as the
    RAM tier, its read buffer about a round's size, each block read once."""
    gen = torch.Generator().manual_seed(9)
    ram, disk = _pair(kv_dir, b=2, h=1, read_chunk=3 * 4096)
    with disk:
        _append_both(ram, disk, PREFILL, gen)
        per_block = disk.block_size // disk.record_bytes
        start, stop = 5, PREFILL // per_block * per_block  # whole blocks on disk, a partial first one
        for out in (None, (torch.zeros(2, 1, CAPACITY, D), torch.zeros(2, 1, CAPACITY, D))):
            disk.stats.reset()
            kd, vd = disk.read_range_async(start, stop, torch.device("cpu"), torch.float32, out=out).result()
            kr, vr = ram.read_range_async(start, stop, torch.device("cpu"), torch.float32).result()
            assert torch.equal(kr, kd) and torch.equal(vr, vd)
            blocks = stop // per_block - start // per_block
            assert disk.stats.bytes == 2 * blocks * disk.block_size  # pieces end at block boundaries
            pieces = stop // (2 * per_block) - start // (2 * per_block)  # two blocks each, the first partial
            assert pieces > 2 and disk.stats.reads == 2 * pieces
        # the buffer's floor (64 KiB), where the span of both regions at once would take 144 KiB
        assert len(disk.threads.read_buffer(0)) <= max(2 * 3 * 4096, 1 << 16) < 2 * blocks * disk.block_size


def test_reading_every_row_goes_a_few_regions_at_a_time(kv_dir, monkeypatch):
    """Full fetch's read of a layer: the same rows as the RAM tier through a buffer of about
    READ_CHUNK bytes, into new tensors and into given buffers."""
    import infinigen.storage.disk as disk_module

    monkeypatch.setattr(disk_module, "READ_CHUNK", 2 * 4096)
    gen = torch.Generator().manual_seed(6)
    ram, disk = _pair(kv_dir, b=3, h=2)
    with disk:
        _append_both(ram, disk, PREFILL, gen)
        _append_both(ram, disk, 1, gen)
        for upto in (1, 100, ram.length):
            kr, vr = ram.read_all(upto, torch.device("cpu"), torch.float32)
            kd, vd = disk.read_all(upto, torch.device("cpu"), torch.float32)
            assert torch.equal(kr, kd) and torch.equal(vr, vd)
            out = (torch.zeros(3, 2, CAPACITY, D), torch.zeros(3, 2, CAPACITY, D))
            kd, vd = disk.read_all(upto, torch.device("cpu"), torch.float32, out=out)
            assert torch.equal(out[0][:, :, :upto], kr) and torch.equal(out[1][:, :, :upto], vr)
        kd, vd = disk.peek_all()
        assert torch.equal(kd, ram.peek_all()[0])
        layer = 3 * 2 * ram.length * 256
        assert len(disk.threads.read_buffer(0)) < layer / 2  # the read buffer alone (staging apart)
