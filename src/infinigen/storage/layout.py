"""Where a disk tier's bytes sit in its file: one object answers every offset and size.

The file holds ``regions`` regions, one per (batch row, KV head), in that order. Each region has
room for ``capacity`` positions and is padded to a whole number of blocks, so every region starts
on a block boundary. Inside a region the positions follow each other in order, and a position's
record is its K row immediately followed by its V row, padded to a power of two that divides the
block (or to whole blocks), so that no record straddles a block boundary::

    region(b, h) = [K_0 V_0][K_1 V_1][K_2 V_2] ... [K_{capacity-1} V_{capacity-1}] pad

The last, partially filled block of every region (its *tail*) is kept in RAM until it fills, in a
buffer of one block per region; `tail_offsets` says where a record sits there.

The tier, its reads, its writes, the C gather (handed offsets computed here) and the memory plan
all ask this object, so that the file's layout is written down in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MIN_BLOCK = 4096  # the smallest I/O block a KV file uses


def round_up(x, m: int):
    """`x` rounded up to a multiple of `m` (integers or numpy arrays)."""
    return -(-x // m) * m


def block_size(directory: Path) -> int:
    """The I/O block of a KV file in `directory`: the file system's block, at least 4 KiB."""
    try:
        fs_block = os.statvfs(directory).f_bsize
    except (OSError, AttributeError):
        fs_block = 0
    block = max(int(fs_block), MIN_BLOCK)
    return block if block % 512 == 0 else MIN_BLOCK


def record_bytes(row_bytes: int, block: int) -> int:
    """A position's record on disk: its K and V row padded to a power of two that divides the
    block, or to whole blocks, so that no record straddles a block boundary."""
    if row_bytes >= block:
        return round_up(row_bytes, block)
    size = 1
    while size < row_bytes:
        size *= 2
    return size


@dataclass(frozen=True)
class DiskLayout:
    """The layout of one KV file: `regions` regions of `capacity` positions, each position's K
    and V row (`row_bytes`) in one record, read and written in blocks of `block` bytes."""

    regions: int
    row_bytes: int
    block: int
    capacity: int
    record: int = field(init=False)  # bytes of one position's record
    region_bytes: int = field(init=False)  # bytes of one region, padded to whole blocks

    def __post_init__(self) -> None:
        object.__setattr__(self, "record", record_bytes(self.row_bytes, self.block))
        object.__setattr__(self, "region_bytes", round_up(self.capacity * self.record, self.block))

    @classmethod
    def in_directory(cls, directory: Path, regions: int, row_bytes: int, capacity: int) -> DiskLayout:
        """The layout of a KV file in `directory` (its block is the file system's)."""
        return cls(regions, row_bytes, block_size(directory), capacity)

    # ------------------------------------------------------------------ the file
    @property
    def file_bytes(self) -> int:
        return self.regions * self.region_bytes

    @property
    def file_blocks(self) -> int:
        return self.file_bytes // self.block

    @property
    def whole_blocks(self) -> bool:
        """Whether a record takes whole blocks (a row longer than a block): blocks hold no two
        records then, and neither the RAM tail nor the block cache serves them."""
        return self.record > self.block

    def at(self, region, within):
        """The file offset of byte `within` of `region` (integers or numpy arrays)."""
        return region * self.region_bytes + within

    def offsets(self, region, pos):
        """The file offset of the record of each (region, position) (integers or numpy arrays)."""
        return self.at(region, self.start(pos))

    def start(self, pos):
        """Where position `pos`'s record starts within its region (integers or numpy arrays)."""
        return pos * self.record

    # ------------------------------------------------------------------ blocks and spans
    def blocks_bytes(self, positions: int) -> int:
        """Bytes of the whole blocks that the first `positions` positions of a region fill."""
        return round_up(self.start(positions), self.block)

    def region_blocks(self, positions: int) -> int:
        """Blocks that the first `positions` positions of a region fill."""
        return self.blocks_bytes(positions) // self.block

    def allocated_bytes(self, positions: int) -> int:
        """Bytes of a region to allocate on disk for its first `positions` positions."""
        return min(self.blocks_bytes(positions), self.region_bytes)

    def reserved_bytes(self, positions: int) -> int:
        """Disk bytes the whole file allocates for its first `positions` positions."""
        return self.regions * self.blocks_bytes(positions)

    def span(self, start: int, stop: int) -> tuple[int, int]:
        """The bytes [lo, hi) of a region that positions [start, stop) touch, in whole blocks."""
        return self.start(start) // self.block * self.block, self.blocks_bytes(stop)

    def touched_blocks(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For records at file `offsets`: the first block of each, and every block they touch
        (sorted, each once)."""
        first = offsets // self.block
        count = (offsets + self.record - 1) // self.block - first + 1
        if int(count.max()) == 1:
            return first, np.unique(first)
        base = np.repeat(np.cumsum(count) - count, count)
        blocks = np.repeat(first, count) + (np.arange(int(count.sum())) - base)
        return first, np.unique(blocks)

    def range_piece(self, read_chunk: int) -> int:
        """The most positions one piece of a range read takes: whole blocks of at most
        `read_chunk` bytes per region wherever the piece starts (two blocks at least)."""
        return max((read_chunk // self.block - 1) * self.block // self.record, 1)

    # ------------------------------------------------------------------ the RAM tail
    def tail_start(self, length: int) -> int:
        """Where, within a region holding `length` positions, the tail block starts: the first
        byte not yet on disk."""
        return self.start(length) // self.block * self.block

    def tail_position(self, length: int) -> int:
        """The first position, of a region holding `length`, that is still in the RAM tail."""
        return self.tail_start(length) // self.record

    @property
    def tails_bytes(self) -> int:
        """Bytes of the RAM tails: one block per region."""
        return self.regions * self.block

    def tail_offsets(self, region: np.ndarray, pos: np.ndarray, length: int) -> np.ndarray:
        """Where the record of each (region, position) sits in the RAM tails ([regions, block]),
        or -1 where it is on disk, for regions holding `length` positions."""
        inside = self.start(pos) - self.tail_start(length)
        return np.where(inside >= 0, region * self.block + inside, -1)
