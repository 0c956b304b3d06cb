"""RAM copies of the disk blocks a tier reads most: a cache in front of the disk, never lossy.

Decode steps select largely the same positions as the step before (recent tokens, sinks, heavy
hitters), so most of the blocks a layer reads were also read the step before. A read from a
solid-state disk costs mostly per request, not per byte, so keeping those blocks in RAM removes
most requests. Every block stays on disk; a copy is only dropped to
make room for another, by CLOCK (second chance: a slot used since the hand last passed is
skipped once), which approximates least-recently-used in O(1) per admission. Unlike the capped
host pool (`storage.pool`), no position is ever lost.

The state is plain arrays so that the C gather (`infinigen/kernels/gather.c`) and the Python
one (`storage.disk_read.DiskReader`) run the very same policy on it.
"""

from __future__ import annotations

import numpy as np
import torch

PINNED, USED, UNUSED = 2, 1, 0  # `ref` of a slot: in use by the current gather, used, not used


class BlockCache:
    """`slots` block copies of `block_size` bytes for a file of `file_blocks` blocks."""

    def __init__(self, slots: int, block_size: int, file_blocks: int) -> None:
        if slots < 1:
            raise ValueError(f"a block cache needs at least one slot, got {slots}")
        self.slots, self.block_size = slots, block_size
        self.data = torch.zeros(slots, block_size, dtype=torch.uint8)
        self.slot_of = np.full(file_blocks, -1, dtype=np.int64)  # block -> slot, -1 when not cached
        self.block_in = np.full(slots, -1, dtype=np.int64)  # slot -> block, -1 when free
        self.ref = np.zeros(slots, dtype=np.uint8)
        self.hand = np.zeros(1, dtype=np.int64)

    @staticmethod
    def planned_bytes(slots: int, block_size: int, file_blocks: int) -> tuple[int, int]:
        """(`nbytes`, `maps_nbytes`) of a cache of `slots` slots for a file of `file_blocks` blocks."""
        maps = file_blocks * 8 + slots * 8 + slots + 8  # block -> slot, slot -> block, ref, hand
        return slots * block_size, maps

    @property
    def nbytes(self) -> int:
        """Bytes of the block copies."""
        return self.slots * self.block_size

    @property
    def maps_nbytes(self) -> int:
        """Bytes of its block/slot maps."""
        return self.slot_of.nbytes + self.block_in.nbytes + self.ref.nbytes + self.hand.nbytes

    def victim(self) -> int:
        """A slot for a new block (CLOCK), never one pinned by the current gather; -1 if none."""
        for _ in range(2 * self.slots + 1):
            s = int(self.hand[0])
            self.hand[0] = (s + 1) % self.slots
            if self.ref[s] == PINNED:
                continue
            if self.ref[s] == USED:
                self.ref[s] = UNUSED
                continue
            return s
        return -1

    def place(self, block: int, slot: int) -> None:
        """`block` now lives in `slot` (the caller copies its bytes into `data[slot]`)."""
        old = self.block_in[slot]
        if old >= 0:
            self.slot_of[old] = -1
        self.block_in[slot] = block
        self.slot_of[block] = slot
        self.ref[slot] = PINNED
