"""Host RAM: the trivial slow tier, and the reference every other tier must match bit for bit."""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from infinigen.storage.base import KVTier, TransferStats, copy_prefix, grown_rows, scatter_rows

# Sequential reads (every row, or a chunk of it) are copied here, off the thread that asks: the
# stand-in for a copy engine moving host memory while the compute goes on, so that a layer read in
# chunks attends one chunk while the next is copied (on the compute thread, the copies of a long
# context would add to every step). One thread for every RAM tier: the reads keep their order.
_COPIES = ThreadPoolExecutor(1, thread_name_prefix="infinigen-ram-copy")


class RamTier(KVTier):
    """One layer's K and V in host memory, grown by the one growth rule (`growing.grown_size`)."""

    def __init__(
        self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, stats: TransferStats, capacity: int = 0
    ) -> None:
        """capacity: positions to make room for at once (the generation's length, if known)."""
        super().__init__(batch, kv_heads, head_dim, dtype, stats)
        self._k = torch.empty(batch, kv_heads, capacity, head_dim, dtype=dtype)
        self._v = torch.empty_like(self._k)

    def stored_bytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def _grow(self, need: int) -> None:
        empty = functools.partial(torch.empty, dtype=self.dtype)
        self._k, self._v = grown_rows((self._k, self._v), self.length, need, empty)

    def _append(self, keys, values, valid) -> None:
        n = keys.shape[2]
        self._grow(self.length + n)
        self._k[:, :, self.length : self.length + n] = keys.detach().to("cpu", self.dtype)
        self._v[:, :, self.length : self.length + n] = values.detach().to("cpu", self.dtype)
        self.length += n

    def _gather(self, indices, valid, device, dtype, out=None):
        start = time.perf_counter()
        flat = valid.nonzero(as_tuple=True)  # (b, h, slot) of the rows that move
        pos = indices[flat]
        capacity = self._k.shape[2]
        source = (flat[0] * self.kv_heads + flat[1]) * capacity + pos  # one linear index per row
        k, v = scatter_rows(
            flat,
            self._k.view(-1, self.head_dim).index_select(0, source),
            self._v.view(-1, self.head_dim).index_select(0, source),
            (*indices.shape, self.head_dim),
            device,
            dtype,
            out,
        )
        rows = int(pos.numel())
        self.stats.add(rows * self.row_bytes, rows, time.perf_counter() - start)
        return k, v

    def _read_range(self, start, stop, device, dtype, out=None):
        t0 = time.perf_counter()
        k, v = copy_prefix(self._k[:, :, start:stop], self._v[:, :, start:stop], device, dtype, out)
        rows = self.batch * self.kv_heads * (stop - start)
        self.stats.add(rows * self.row_bytes, rows, time.perf_counter() - t0)
        return k, v

    def _read_range_async(self, start, stop, device, dtype, out=None) -> Future:
        return _COPIES.submit(self._read_range, start, stop, device, dtype, out)

    def in_place(self):
        return self._k, self._v

    def peek_all(self):
        return self._k[:, :, : self.length], self._v[:, :, : self.length]
