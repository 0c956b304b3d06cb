"""Pinned host memory behind PCIe, for a CUDA compute device.

The full K and V of a layer live in page-locked host memory. A fetch gathers the selected rows
on the host into a pinned staging buffer and copies them to the device on a side stream; the
compute stream later waits on that copy's event only (``wait_event``), so the decode path never
synchronizes the whole device. New KV rows go device→host on another side stream, ordered after
the compute that produced them; a host-side gather of a row waits (on the host) for the event of
the write that stored it.
"""

from __future__ import annotations

import time

import torch

from infinigen.storage.base import KVTier, TransferStats, prefix_views


class CudaTransfer:
    """A fetch in flight: `result()` makes the current stream wait for it (no host sync)."""

    def __init__(self, tensors: tuple[torch.Tensor, torch.Tensor], event, keepalive) -> None:
        self._tensors = tensors
        self._event = event
        self._keepalive = keepalive  # staging buffers must outlive the copy

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        torch.cuda.current_stream(self._tensors[0].device).wait_event(self._event)
        return self._tensors


class PinnedTier(KVTier):
    """One layer's KV in pinned host RAM; transfers on side streams with one event each."""

    def __init__(
        self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, stats: TransferStats, device
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the pinned tier needs a CUDA device; use tier='ram' or tier='disk' on this machine")
        super().__init__(batch, kv_heads, head_dim, dtype, stats)
        self.device = torch.device(device)
        self._k = torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, pin_memory=True)
        self._v = torch.empty_like(self._k, pin_memory=True)
        self._copy_stream = torch.cuda.Stream(self.device)
        self._write_stream = torch.cuda.Stream(self.device)
        self._write_event: torch.cuda.Event | None = None

    def _grow(self, need: int) -> None:
        cap = self._k.shape[2]
        if need <= cap:
            return
        self._host_ready()
        new_cap = max(need, 2 * cap, 256)
        k = torch.empty(self.batch, self.kv_heads, new_cap, self.head_dim, dtype=self.dtype, pin_memory=True)
        v = torch.empty_like(k, pin_memory=True)
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v

    def _host_ready(self) -> None:
        """Wait (host side, this event only) until the last device→host write landed."""
        if self._write_event is not None:
            self._write_event.synchronize()

    def _append(self, keys, values, valid) -> None:
        n = keys.shape[2]
        self._grow(self.length + n)
        produced = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self._write_stream):
            self._write_stream.wait_event(produced)
            self._k[:, :, self.length : self.length + n].copy_(keys.detach().to(self.dtype), non_blocking=True)
            self._v[:, :, self.length : self.length + n].copy_(values.detach().to(self.dtype), non_blocking=True)
            keys.record_stream(self._write_stream)
            values.record_stream(self._write_stream)
            self._write_event = self._write_stream.record_event()
        self.length += n

    def _gather_async(self, indices, valid, device, dtype, out=None) -> CudaTransfer:
        start = time.perf_counter()
        self._host_ready()
        b, h, n = indices.shape
        idx = indices.to("cpu")
        ok = valid.to("cpu")
        flat = ok.nonzero(as_tuple=True)
        pos = idx[flat]
        stage_k = torch.zeros(b, h, n, self.head_dim, dtype=self.dtype, pin_memory=True)
        stage_v = torch.zeros_like(stage_k, pin_memory=True)
        stage_k[flat] = self._k[flat[0], flat[1], pos]
        stage_v[flat] = self._v[flat[0], flat[1], pos]
        k, v = self._to_device(stage_k, stage_v, device, dtype, out)
        event = self._copy_stream.record_event()
        rows = int(pos.numel())
        self.stats.add(rows * self.row_bytes, rows, time.perf_counter() - start)
        return CudaTransfer((k, v), event, (stage_k, stage_v))

    def _read_all_async(self, upto, device, dtype, out=None) -> CudaTransfer:
        start = time.perf_counter()
        self._host_ready()
        src_k, src_v = self._k[:, :, :upto], self._v[:, :, :upto]
        k, v = self._to_device(src_k, src_v, device, dtype, out)
        event = self._copy_stream.record_event()
        rows = self.batch * self.kv_heads * upto
        self.stats.add(rows * self.row_bytes, rows, time.perf_counter() - start)
        return CudaTransfer((k, v), event, (self._k, self._v))

    def _to_device(self, src_k, src_v, device, dtype, out):
        """Host→device copies on the side stream; into `out` after everything the compute stream
        was given so far (its last reader of those buffers included)."""
        compute = torch.cuda.current_stream(torch.device(device))
        with torch.cuda.stream(self._copy_stream):
            if out is None:
                return src_k.to(device, non_blocking=True).to(dtype), src_v.to(device, non_blocking=True).to(dtype)
            self._copy_stream.wait_stream(compute)
            k, v = prefix_views(out, src_k.shape[2])
            k.copy_(src_k, non_blocking=True)
            v.copy_(src_v, non_blocking=True)
            return k, v

    def peek_all(self):
        self._host_ready()
        return self._k[:, :, : self.length], self._v[:, :, : self.length]
