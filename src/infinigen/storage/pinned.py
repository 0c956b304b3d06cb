"""Host memory behind a link to the compute device (pinned host RAM behind PCIe, for a GPU).

The full K and V of a layer live in host buffers of the copy engine (page-locked on CUDA),
preallocated for the generation's length when it is known. New rows go device→host on the
engine's write queue, after the compute that produced them. A gather sizes itself on the host
(the selected indices come to the host: the only host sync of a decode step), copies the rows
into a staging buffer with one index_select per K and V, and queues one host→device copy of the
packed rows plus one scatter into the layer's preallocated device buffer on the copy queue. The
compute waits on that transfer's marker only (`result()`), never on the whole device. The same
code runs on CUDA streams and on CPU threads (`storage/copyengine.py`).
"""

from __future__ import annotations

import functools
import time

import torch

from infinigen.storage.base import KVTier, TransferStats, grown_rows, prefix_views
from infinigen.storage.copyengine import CopyEngine


class EngineTransfer:
    """A fetch in flight: `result()` orders the caller's compute after it (on CUDA without a host
    sync) and hands back the rows' device views."""

    def __init__(self, engine: CopyEngine, marker, tensors: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._engine, self._marker, self._tensors = engine, marker, tensors

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._engine.device_wait(self._marker)
        return self._tensors


class PinnedTier(KVTier):
    """One layer's KV in the copy engine's host buffers (see the module docstring).

    capacity: positions to allocate at once (the generation's length, if known), so that a
    decode step never reallocates page-locked memory."""

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        stats: TransferStats,
        engine: CopyEngine,
        capacity: int = 0,
    ) -> None:
        super().__init__(batch, kv_heads, head_dim, dtype, stats)
        self.engine = engine
        self.device = engine.device
        self._k = engine.host_empty((batch, kv_heads, capacity, head_dim), dtype)
        self._v = engine.host_empty((batch, kv_heads, capacity, head_dim), dtype)
        self._written = None  # marker of the last device→host write

    def stored_bytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def _grow(self, need: int) -> None:
        if need > self._k.shape[2]:
            self._host_ready()  # the rows written last are copied, so they must have landed
            empty = functools.partial(self.engine.host_empty, dtype=self.dtype)
            self._k, self._v = grown_rows((self._k, self._v), self.length, need, empty)

    def _host_ready(self) -> None:
        """Wait (host side, for the last write only) until every stored row is in host memory."""
        if self._written is not None:
            self.engine.host_wait(self._written)
            self._written = None

    def _append(self, keys, values, valid) -> None:
        n = keys.shape[2]
        self._grow(self.length + n)
        # Converted and made contiguous on the compute side, then one asynchronous copy per
        # (batch row, KV head) into that region's contiguous rows of host memory.
        src_k = keys.detach().to(self.dtype).contiguous()
        src_v = values.detach().to(self.dtype).contiguous()
        dst_k = self._k[:, :, self.length : self.length + n]
        dst_v = self._v[:, :, self.length : self.length + n]

        def store() -> None:
            for dst, src in ((dst_k, src_k), (dst_v, src_v)):
                for b in range(self.batch):
                    for h in range(self.kv_heads):
                        dst[b, h].copy_(src[b, h], non_blocking=True)

        # The write queue runs in order: waiting for the last write waits for every earlier one.
        self._written = self.engine.write(store, self.engine.compute_marker(), keepalive=(src_k, src_v))
        self.length += n

    def _gather_async(self, indices, valid, device, dtype, out=None) -> EngineTransfer:
        start = time.perf_counter()
        b, h, n = indices.shape
        d = self.head_dim
        ok = valid.to("cpu")  # sizing the gather: the one host sync of a decode step
        flat = ok.nonzero(as_tuple=True)
        pos = indices.to("cpu")[flat]
        m = int(pos.numel())
        self._host_ready()
        capacity = self._k.shape[2]
        source = (flat[0] * self.kv_heads + flat[1]) * capacity + pos
        key = ("gather", _buffer_key(out))
        stage_k, stage_v = self.engine.staging(key, m, d, self.dtype)
        torch.index_select(self._k.view(-1, d), 0, source, out=stage_k[:m])
        torch.index_select(self._v.view(-1, d), 0, source, out=stage_v[:m])
        if out is None:
            out = (
                torch.zeros(b, h, n, d, dtype=dtype, device=device),
                torch.zeros(b, h, n, d, dtype=dtype, device=device),
            )
        k_out, v_out = prefix_views(out, n)
        contiguous = out[0].is_contiguous() and out[1].is_contiguous()
        out_room = out[0].shape[2]
        if contiguous:  # one linear index per row, staged with the rows: one copy each
            dest = self.engine.staging((*key, "index"), m, 1, torch.int64)[0][:m, 0]
            torch.add(flat[2], (flat[0] * h + flat[1]) * out_room, out=dest)
        else:
            dest = None
        rows_k, rows_v = stage_k[:m], stage_v[:m]

        def land() -> None:
            got_k = rows_k.to(device, non_blocking=True).to(dtype)
            got_v = rows_v.to(device, non_blocking=True).to(dtype)
            if contiguous:
                where = dest.to(device, non_blocking=True)
                out[0].view(-1, d).index_copy_(0, where, got_k)
                out[1].view(-1, d).index_copy_(0, where, got_v)
            else:  # rare (buffers a caller sliced): plain indexing
                where = tuple(t.to(device) for t in flat)
                k_out[where] = got_k
                v_out[where] = got_v

        marker = self.engine.copy(land, keepalive=(out[0], out[1]))
        self.engine.staged(key, marker)
        if contiguous:
            self.engine.staged((*key, "index"), marker)
        self.stats.add(m * self.row_bytes, m, time.perf_counter() - start)
        return EngineTransfer(self.engine, marker, (k_out, v_out))

    def _read_range_async(self, start, stop, device, dtype, out=None) -> EngineTransfer:
        t0 = time.perf_counter()
        self._host_ready()
        n = stop - start
        src_k, src_v = self._k[:, :, start:stop], self._v[:, :, start:stop]
        if out is None:
            shape = (self.batch, self.kv_heads, n, self.head_dim)
            out = (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
        k, v = prefix_views(out, n)

        def land() -> None:
            # One asynchronous copy per (batch row, KV head): each region's rows [start, stop) are
            # contiguous in host memory, in the storage dtype; converted on the device after.
            shape = (self.batch, self.kv_heads, n, self.head_dim)
            for dst, src in ((k, src_k), (v, src_v)):
                landing = torch.empty(shape, dtype=self.dtype, device=device)
                for b in range(self.batch):
                    for h in range(self.kv_heads):
                        landing[b, h].copy_(src[b, h], non_blocking=True)
                dst.copy_(landing)

        marker = self.engine.copy(land, keepalive=(out[0], out[1]))
        rows = self.batch * self.kv_heads * n
        self.stats.add(rows * self.row_bytes, rows, time.perf_counter() - t0)
        return EngineTransfer(self.engine, marker, (k, v))

    def peek_all(self):
        self._host_ready()
        return self._k[:, :, : self.length], self._v[:, :, : self.length]

    def close(self) -> None:
        self._host_ready()


def _buffer_key(out) -> int | None:
    """Which destination a staging buffer feeds: transfers into one destination run one after
    another (a layer's transfers; layers sharing `RowBuffers`), so they may share staging."""
    return None if out is None else out[0].data_ptr()
