"""A disk tier's reads: which blocks a gather needs, how they are merged and split into requests
and rounds, and the reads themselves (the C gather, or the same steps in Python).

* A decode step selects positions independently per (batch row, KV head) and always needs both
  K and V of a selected position; a position's record holds both, so one selected row costs one
  block read instead of two.
* Within a region, nearby positions share a block. Attention selections cluster (recent tokens,
  sink tokens, local runs), so neighbouring selected positions are mostly served by the same or
  adjacent blocks.
* A selection, sorted ascending per region, maps to an ascending list of blocks; blocks whose gap
  is at most ``coalesce_gap_blocks`` are merged into one larger read, because reading a small gap
  costs less than issuing another request. The merged runs are read with several requests in
  flight, which is what fast SSDs need to reach their bandwidth.
* A gather reads in rounds whose blocks fit ``read_chunk`` bytes, so that the shared read buffer
  stays about that size however large the batch and the context.
* A range read (a prefix, or a chunk of one) is one sequential read per region, in pieces of at
  most about ``read_chunk`` bytes.

Rows in the RAM tail, and blocks in the block cache, are served from RAM.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import torch

import infinigen.kernels as kernels
from infinigen.storage.base import KVStorageError, copy_prefix, prefix_views
from infinigen.storage.blockcache import PINNED, USED, BlockCache
from infinigen.storage.disk_file import DiskFile, IOThreads
from infinigen.storage.layout import DiskLayout

MAX_REQUEST = 1 << 20  # a merged run longer than this is read in several requests


class ReadPlan:
    """How a gather lays its reads out in the read buffer: blocks merged into runs across gaps
    of at most `gap` blocks, runs split into requests of at most `max_request` bytes, and rows
    grouped into rounds. Pure arithmetic on file offsets: it reads nothing."""

    def __init__(self, layout: DiskLayout, gap: int, max_request: int = MAX_REQUEST) -> None:
        self.layout, self.gap, self.max_request = layout, gap, max_request

    @staticmethod
    def planned_buffer(layout: DiskLayout, read_chunk: int, positions: int, rows: int, span: int) -> int:
        """The read buffer a tier of `layout` grows to when a step reads at most `rows` rows of
        a region holding `positions`, and range reads take at most `span` positions of a region
        (0: no range reads). Rounds hold about `read_chunk` bytes; a range read's piece takes
        the whole blocks it touches, plus one where it does not start on a block."""
        blk = layout.block
        read = min(layout.regions * min(layout.region_blocks(positions), rows) * blk, read_chunk)
        if span:
            piece = min(span, layout.range_piece(read_chunk))
            read = max(read, (layout.region_blocks(piece) + 1) * blk)
        return IOThreads.planned_read_buffer(read)

    def merged(self, steps: np.ndarray) -> np.ndarray:
        """Whether a block `steps` blocks after the previous one read joins its run: the gap
        between them is at most `gap` (the rule the C gather applies too)."""
        return steps <= self.gap + 1

    def runs(self, blocks: np.ndarray):
        """Sorted unique blocks merged into runs. Returns (runs, buffer byte offset of every
        block, buffer bytes); runs are (first block, blocks, buffer block offset)."""
        blk = self.layout.block
        cut = np.nonzero(~self.merged(np.diff(blocks)))[0] + 1
        run_first = blocks[np.concatenate(([0], cut))]
        run_last = blocks[np.concatenate((cut - 1, [len(blocks) - 1]))]
        run_len = run_last - run_first + 1
        run_buf = np.cumsum(run_len) - run_len
        which = np.searchsorted(run_first, blocks, side="right") - 1
        where = (run_buf[which] + blocks - run_first[which]) * blk
        return (run_first, run_len, run_buf), where, int(run_len.sum()) * blk

    def records(self, offsets: np.ndarray):
        """The blocks holding the records at file `offsets`, merged into runs. Returns (runs,
        record offsets in the read buffer, buffer bytes)."""
        first, blocks = self.layout.touched_blocks(offsets)
        runs, _, nbytes = self.runs(blocks)
        run_first, _, run_buf = runs
        which = np.searchsorted(run_first, first, side="right") - 1
        return runs, (run_buf[which] - run_first[which]) * self.layout.block + offsets, nbytes

    def requests(self, runs, view: memoryview) -> list[tuple[memoryview, int]]:
        """(buffer, file offset) of every read request: a run, or a piece of at most `max_request`."""
        blk = self.layout.block
        per = max(self.max_request // blk, 1)
        out = []
        for f, n, b in zip(*(r.tolist() for r in runs)):
            for i in range(0, n, per):
                m = min(per, n - i)
                out.append((view[(b + i) * blk : (b + i + m) * blk], (f + i) * blk))
        return out

    def round_costs(self, offsets: np.ndarray, tail_at: np.ndarray) -> np.ndarray:
        """The read buffer's bytes each row adds to a round that holds the rows before it, as the
        gather lays its reads out without a block cache (a cache only makes them fewer): a row that
        opens a block adds that block, and the blocks of the gap before it when the gap is short
        enough to be merged into the previous run; a row in the previous row's block, or in the
        RAM tail, adds nothing."""
        blk, gap = self.layout.block, self.gap
        cost = np.zeros(len(offsets), dtype=np.int64)
        disk = np.flatnonzero(tail_at < 0)
        if not len(disk):
            return cost
        if self.layout.whole_blocks:  # records of whole blocks: each costs its blocks and a gap at most
            cost[disk] = self.layout.record + gap * blk
            return cost
        block = offsets[disk] // blk
        step = np.diff(block, prepend=-(gap + 2))  # the first opens a run of its own
        cost[disk] = np.where(step == 0, 0, np.where(self.merged(step), step, 1)) * blk
        return cost

    def rounds(self, offsets: np.ndarray, tail_at: np.ndarray, read_chunk: int):
        """(first, end) of each round of rows whose blocks fit `read_chunk` bytes, counted as the
        gather reads them (`round_costs`). Rounds split where a block starts: rows that share
        blocks (a page, a run) cost their blocks once, not a block each."""
        cost = self.round_costs(offsets, tail_at)
        cum = np.cumsum(cost)
        starts = np.flatnonzero(cost)  # the rows that open a block
        left = read_chunk - self.layout.block  # a round's first row opens its first block
        first, m = 0, len(offsets)
        while first < m:
            end = int(np.searchsorted(cum, cum[first] + left, side="right"))
            if end < m and cost[end] == 0:  # do not split a block: end the round where it starts
                opener = starts[np.searchsorted(starts, end, side="right") - 1] if len(starts) else 0
                end = int(opener) if opener > first else end
            end = max(end, first + 1)
            yield first, end
            first = end


class DiskReader:
    """The reads of one disk tier: records from the RAM `tails`, the block `cache` or `file`,
    in rounds of at most about `read_chunk` bytes through the shared read buffer; range reads."""

    def __init__(
        self,
        layout: DiskLayout,
        file: DiskFile,
        tails: torch.Tensor,
        cache: BlockCache | None,
        gap: int,
        read_chunk: int,
        dtype: torch.dtype,
        head_dim: int,
    ) -> None:
        self.layout, self.file, self.tails, self.cache = layout, file, tails, cache
        self.plan = ReadPlan(layout, gap)
        self.read_chunk, self.dtype, self.head_dim = read_chunk, dtype, head_dim

    def _buffer(self, nbytes: int):
        """The read buffer of the file's I/O threads, grown to `nbytes` (page aligned)."""
        return self.file.threads.read_buffer(nbytes)

    def records(self, offsets: np.ndarray, tail_at: np.ndarray, rows: torch.Tensor):
        """The records at file `offsets` (sorted), or at `tail_at` in the RAM tails where that is
        not -1, into rows [m, record], round after round. Returns (bytes read, reads, rows from
        disk, rows from RAM)."""
        total = (0, 0, 0, 0)
        for first, end in self.plan.rounds(offsets, tail_at, self.read_chunk):
            got = self._round(offsets[first:end], tail_at[first:end], rows[first:end])
            total = tuple(a + b for a, b in zip(total, got))
        return total

    def _round(self, offsets: np.ndarray, tail_at: np.ndarray, rows: torch.Tensor):
        """One round: the C gather, or its Python reference where there is no kernel."""
        lib = kernels.library() if not self.layout.whole_blocks else None
        if lib is None:
            return self._round_python(offsets, tail_at, rows)
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        tail_at = np.ascontiguousarray(tail_at, dtype=np.int64)
        m, lay, cache, plan = len(offsets), self.layout, self.cache, self.plan
        work = np.empty(2 * m, dtype=np.int64)
        stats = np.zeros(5, dtype=np.int64)
        self.file.drop_cache()
        while True:
            buf = self._buffer(0)
            rc = lib.ig_gather_rows(
                self.file.fd, lay.block, lay.record, m, offsets.ctypes.data, tail_at.ctypes.data,
                self.tails.data_ptr(),
                cache.data.data_ptr() if cache else None, cache.slots if cache else 0,
                cache.slot_of.ctypes.data if cache else None, cache.block_in.ctypes.data if cache else None,
                cache.ref.ctypes.data if cache else None, cache.hand.ctypes.data if cache else None,
                plan.gap, plan.max_request, self.file.aio, self.file.threads.read_address,
                len(buf), work.ctypes.data, work[m:].ctypes.data, rows.data_ptr(), stats.ctypes.data,
            )  # fmt: skip
            if rc > 0:
                self._buffer(int(rc))  # grow the read buffer and try again
                continue
            if rc < 0:
                err = -int(rc)
                what = "short read from" if err == errno.EIO else "reading"
                raise KVStorageError(err, f"{what} a KV file in {self.file.directory} failed: {os.strerror(err)}")
            return int(stats[0]), int(stats[1]), int(stats[2]), int(stats[3])

    def _read(self, runs, nbytes: int):
        """Read `runs` into the read buffer; (buffer, requests issued)."""
        buf = self._buffer(nbytes)
        reqs = self.plan.requests(runs, memoryview(buf))
        self.file.drop_cache()
        self.file.read_many(reqs)
        return buf, len(reqs)

    def _round_python(self, offsets: np.ndarray, tail_at: np.ndarray, rows: torch.Tensor):
        """`_round` without the C kernel: the same reads, the same cache policy."""
        rec, blk, cache = self.layout.record, self.layout.block, self.cache
        m = len(offsets)
        in_tail = tail_at >= 0
        if in_tail.any():
            t = np.nonzero(in_tail)[0]
            rows[torch.from_numpy(t)] = self.tails.view(-1, rec)[torch.from_numpy(tail_at[t] // rec)]
        d = np.nonzero(~in_tail)[0]
        if not len(d):
            return 0, 0, 0, m
        if self.layout.whole_blocks:  # records span whole blocks (no cache then): plan them block by block
            runs, at, nbytes = self.plan.records(offsets[d])
            buf, reads = self._read(runs, nbytes)
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
            rows[torch.from_numpy(d)] = raw.view(-1, rec)[torch.from_numpy(at // rec)]
            return nbytes, reads, len(d), m - len(d)
        start = offsets[d]
        blocks, which = np.unique(start // blk, return_inverse=True)
        slots = cache.slot_of[blocks] if cache is not None else np.full(len(blocks), -1, dtype=np.int64)
        hit = slots >= 0
        if cache is not None:
            cache.ref[slots[hit]] = PINNED
        nbytes, reads, where, buf = 0, 0, np.full(len(blocks), -1, dtype=np.int64), None
        if not hit.all():
            missing = np.nonzero(~hit)[0]
            runs, at, nbytes = self.plan.runs(blocks[missing])
            where[missing] = at
            buf, reads = self._read(runs, nbytes)
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

    def span(self, start: int, stop: int, heads: tuple[int, int], length: int, out=None, device=None, dtype=None):
        """Positions [start, stop) of every region, of regions holding `length`, as K and V
        [*heads, stop - start, d] (into `out`, or new tensors of the stored dtype on the CPU), the
        bytes read from disk and the reads: one sequential read per region for the whole blocks the
        span covers, in pieces of at most about `read_chunk` bytes (so that the read buffer stays
        about that size whatever the span: a whole layer at a long context, a sliding window); the
        tail block comes from RAM."""
        n, d, regions = stop - start, self.head_dim, self.layout.regions
        if n == 0:
            empty = torch.empty(*heads, 0, d, dtype=self.dtype)
            return (*copy_prefix(empty, empty, device or "cpu", dtype or self.dtype, out), 0, 0)
        if out is not None:
            k, v = prefix_views(out, n)
        else:
            k = torch.empty(*heads, n, d, dtype=dtype or self.dtype, device=device or "cpu")
            v = torch.empty_like(k)
        flat_k, flat_v = k.view(regions, n, d), v.view(regions, n, d)  # views: written through
        piece = self.layout.range_piece(self.read_chunk)
        nbytes = reads = 0
        # pieces end at multiples of `piece` (whole blocks), so no two read the same block
        edges = [start, *range((start // piece + 1) * piece, stop, piece), stop]
        for lo, hi in zip(edges, edges[1:]):
            got = self._piece(lo, hi, flat_k[:, lo - start : hi - start], flat_v[:, lo - start : hi - start], length)
            nbytes, reads = nbytes + got, reads + (regions if got else 0)
        return k, v, nbytes, reads

    def _piece(self, start: int, stop: int, flat_k: torch.Tensor, flat_v: torch.Tensor, length: int) -> int:
        """Positions [start, stop) of every region into flat_k, flat_v [regions, n, d]; the bytes
        read from disk."""
        lay, d, n = self.layout, self.head_dim, stop - start
        rec, regions, width = lay.record, lay.regions, lay.row_bytes
        lo, hi = lay.span(start, stop)
        span, tail = hi - lo, lay.tail_start(length)
        on_disk = max(min(hi, tail) - lo, 0)  # whole blocks on disk; the rest is the RAM tail
        first = lay.start(start) - lo  # the span's first record within the blocks read
        group = max(self.read_chunk // span, 1)  # regions per read: the buffer stays about `read_chunk`
        for r0 in range(0, regions, group):
            r1 = min(r0 + group, regions)
            buf = self._buffer(span * (r1 - r0))
            view = memoryview(buf)
            if on_disk:
                self.file.drop_cache()
                self.file.read_many(
                    [(view[(r - r0) * span : (r - r0) * span + on_disk], lay.at(r, lo)) for r in range(r0, r1)]
                )
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=span * (r1 - r0)).view(r1 - r0, span)
            if span > on_disk:
                raw[:, on_disk:span] = self.tails[r0:r1, lo + on_disk - tail : hi - tail]
            recs = raw[:, first : first + n * rec].reshape(r1 - r0, n, rec)[..., :width].view(self.dtype)
            flat_k[r0:r1].copy_(recs[..., :d])
            flat_v[r0:r1].copy_(recs[..., d:])
        return on_disk * regions
