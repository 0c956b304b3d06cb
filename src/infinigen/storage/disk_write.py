"""A disk tier's appends: records packed into whole blocks, the partial last block kept in RAM.

The last, partially filled block of every region (the *tail*) lives in RAM; only whole blocks
are written. A prefill writes its whole blocks at once; a decode step only fills the tail, and
when a block fills it is handed to the I/O thread that also runs the gathers, so the compute
thread never waits for a write and a gather, queued behind it, always sees it on disk. A write
that fails is reported by the tier's next append, read or `flush()`.
"""

from __future__ import annotations

import mmap
from concurrent.futures import Future

import torch

from infinigen.storage.disk_file import DiskFile, aligned
from infinigen.storage.layout import DiskLayout

STAGE_KEEP = 1 << 20  # append staging buffers up to this size are kept and reused


class TailWriter:
    """The RAM tails of a disk tier's regions ([regions, block] bytes, `tails`) and the appends
    that fill them and write whole blocks to `file`."""

    def __init__(self, layout: DiskLayout, file: DiskFile, dtype: torch.dtype, head_dim: int) -> None:
        self.layout, self.file, self.dtype, self.head_dim = layout, file, dtype, head_dim
        self.tails = torch.zeros(layout.regions, layout.block, dtype=torch.uint8)
        self._pending: list[Future] = []  # block writes handed to the I/O thread

    @staticmethod
    def planned_staging(layout: DiskLayout, appended: int) -> int:
        """The staging buffer kept for appends of at most `appended` positions (0: none is kept)."""
        need = layout.regions * layout.blocks_bytes(appended)
        return need if need <= STAGE_KEEP else 0

    def append(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Records of `keys`, `values` [B, Hkv, n, d] after the `length` positions held."""
        lay, n = self.layout, keys.shape[2]
        rec, regions, width = lay.record, lay.regions, lay.row_bytes
        if n == 1 and not lay.whole_blocks:  # a decode step: straight into the RAM tail, converted there
            self._append_one(keys, values, length)
            return
        k = keys.detach().to("cpu", self.dtype)
        v = values.detach().to("cpu", self.dtype)
        records = torch.cat([k, v], dim=-1).contiguous().view(torch.uint8).reshape(regions, n, width)

        begin = lay.start(length)  # where the first new record starts within a region
        end = lay.start(length + n)
        start = lay.tail_start(length)  # the tail block begins here: [start, begin) is kept in RAM
        full_end = lay.tail_start(length + n)  # whole blocks [start, full_end) can now be written
        lead = begin - start
        if full_end <= start:  # the new records stay in the tail block: RAM only
            self.tails[:, lead : lead + n * rec].view(regions, n, rec)[:, :, :width] = records
            return

        span = lay.blocks_bytes(length + n) - start
        buf = self._staging(regions * span, keep=n > 1)
        staged = torch.frombuffer(buf, dtype=torch.uint8, count=regions * span).view(regions, span)
        staged[:, :lead] = self.tails[:, :lead]
        body = staged[:, lead : lead + n * rec].view(regions, n, rec)
        if width < rec:
            body.zero_()
        body[:, :, :width] = records
        staged[:, lead + n * rec :] = 0
        whole = full_end - start
        view = memoryview(buf)
        writes = [(view[r * span : r * span + whole], lay.at(r, start)) for r in range(regions)]
        if n > 1:
            self.file.write_many(writes, length + n)  # a prefill: its blocks are written before it returns
        else:  # a decode step filled a block: written behind, ahead of any later gather
            self._write_behind(writes, buf, length + n)
        if end > full_end:
            self.tails[:, : end - full_end] = staged[:, whole : whole + end - full_end]

    def _append_one(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """One position: its record goes into the tail block in RAM; a tail block it fills is
        handed, whole, to the I/O thread (written behind, ahead of any later gather)."""
        lay, d = self.layout, self.head_dim
        rec, blk, regions = lay.record, lay.block, lay.regions
        begin = lay.start(length)
        lead = begin - lay.tail_start(length)
        typed = self.tails[:, lead : lead + rec].view(self.dtype)  # [regions, rec / itemsize]
        typed[:, :d] = keys.detach().reshape(regions, d)
        typed[:, d : 2 * d] = values.detach().reshape(regions, d)
        if (begin + rec) % blk == 0:  # the tail block is full
            buf = aligned(regions * blk)
            torch.frombuffer(buf, dtype=torch.uint8, count=regions * blk).view(regions, blk).copy_(self.tails)
            view = memoryview(buf)
            start = begin + rec - blk
            writes = [(view[r * blk : (r + 1) * blk], lay.at(r, start)) for r in range(regions)]
            self._write_behind(writes, buf, length + 1)

    def _staging(self, need: int, keep: bool) -> mmap.mmap:
        """An aligned buffer for a write; a prefill's reuses the buffer its I/O threads keep
        (written before the next), a decode step's is its own (written later, behind the compute)."""
        if not keep or need > STAGE_KEEP:
            return aligned(need)
        return self.file.threads.stage_buffer(max(need, self.layout.tails_bytes))

    def _write_behind(self, writes: list[tuple[memoryview, int]], buf: mmap.mmap, positions: int) -> None:
        """Hand `writes` (from `buf`, kept alive until written) to the I/O thread that runs the gathers."""
        self._pending.append(self.file.threads.control.submit(_write, self.file, writes, buf, positions))

    def raise_errors(self, wait: bool) -> None:
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

    def settle(self) -> None:
        """Wait for every block written behind, errors dropped (the file is about to close)."""
        for f in self._pending:
            f.exception()
        self._pending = []


def _write(file: DiskFile, writes: list[tuple[memoryview, int]], keepalive, positions: int) -> None:
    file.write_many(writes, positions)
