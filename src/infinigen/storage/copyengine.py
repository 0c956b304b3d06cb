"""How rows cross from host memory to the compute device, asynchronously and in issue order.

The pinned tier (`storage/pinned.py`) is written once, against this small interface, and runs on
two engines:

`CudaCopyEngine`   page-locked host buffers; device→host writes and host→device copies on two
                   side streams, ordered against the compute stream with events, so the decode
                   path never synchronizes the whole device. The compute waits on one transfer's
                   event only (`stream.wait_event`), not on the host.
`ThreadCopyEngine` the same protocol with CPU threads as the two queues and futures as events.
                   It runs the tier's logic on a machine without a GPU (tests; a CPU host that
                   wants its copies off the compute thread) and can delay every copy, so that a
                   missing wait shows up as wrong rows instead of passing by luck.

A *marker* is what an engine hands back for work it queued: a CUDA event or a future. The tier
waits on markers in exactly two ways: `host_wait` (the host needs the bytes, e.g. before reading
rows a write is still storing, or before refilling a staging buffer a copy still reads) and
`device_wait` (the compute needs the bytes). Staging buffers are the engine's, keyed by the
destination they feed, so that two transfers in flight never share one.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

Pair = tuple[torch.Tensor, torch.Tensor]


class CopyEngine(ABC):
    """Two ordered queues between host memory and one compute device (see the module docstring)."""

    device: torch.device

    def __init__(self) -> None:
        self._staging: dict[Any, tuple[Pair, Any]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ buffers
    @abstractmethod
    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized host buffer the queues can copy from and into at full speed."""

    def staging(self, key: Any, rows: int, width: int, dtype: torch.dtype) -> Pair:
        """Host buffers [>= rows, width] (K, V) for the transfer that feeds `key`, grown by
        doubling; waits (host side) until the copy that last read them has finished."""
        with self._lock:
            held = self._staging.get(key)
        if held is not None:
            (k, v), last = held
            if last is not None:
                self.host_wait(last)
            if k.shape[0] >= rows and k.dtype == dtype and k.shape[1] == width:
                return k, v
            rows = max(rows, 2 * k.shape[0])
        pair = (self.host_empty((max(rows, 16), width), dtype), self.host_empty((max(rows, 16), width), dtype))
        with self._lock:
            self._staging[key] = (pair, None)
        return pair

    def staged(self, key: Any, marker: Any) -> None:
        """The staging buffers of `key` are read by the copy `marker` stands for."""
        with self._lock:
            pair, _ = self._staging[key]
            self._staging[key] = (pair, marker)

    # ------------------------------------------------------------------ queues
    @abstractmethod
    def compute_marker(self) -> Any:
        """A marker of every compute the caller has issued so far."""

    @abstractmethod
    def write(self, fn: Callable[[], None], after: Any, keepalive: tuple = ()) -> Any:
        """Queue `fn` (device→host copies) on the write queue after `after`; its marker."""

    @abstractmethod
    def copy(self, fn: Callable[[], None], keepalive: tuple = ()) -> Any:
        """Queue `fn` (host→device copies) on the copy queue, after every compute issued so far
        (its destination's last reader included); its marker."""

    @abstractmethod
    def host_wait(self, marker: Any) -> None:
        """Block the calling thread until the work `marker` stands for is done."""

    @abstractmethod
    def device_wait(self, marker: Any) -> None:
        """Order the caller's later compute after `marker` (without blocking the host if the
        device can wait by itself)."""

    def close(self) -> None:  # noqa: B027 - engines without threads hold nothing to release
        """Stop the queues (after everything queued ran)."""


class CudaCopyEngine(CopyEngine):
    """Side streams and events of one CUDA device."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError("the pinned tier needs a CUDA device; use tier='ram' or tier='disk' on this machine")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise RuntimeError(f"CudaCopyEngine needs a CUDA device, got {self.device}")
        self._copy_stream = torch.cuda.Stream(self.device)
        self._write_stream = torch.cuda.Stream(self.device)

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def compute_marker(self):
        return torch.cuda.current_stream(self.device).record_event()

    def write(self, fn, after, keepalive=()):
        with torch.cuda.stream(self._write_stream):
            self._write_stream.wait_event(after)
            fn()
            for t in keepalive:  # device tensors the side stream reads: not reused before it did
                if t.is_cuda:
                    t.record_stream(self._write_stream)
            return self._write_stream.record_event()

    def copy(self, fn, keepalive=()):
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_stream(compute)
            fn()
            for t in keepalive:
                if t.is_cuda:
                    t.record_stream(self._copy_stream)
            return self._copy_stream.record_event()

    def host_wait(self, marker):
        marker.synchronize()

    def device_wait(self, marker):
        torch.cuda.current_stream(self.device).wait_event(marker)


class ThreadCopyEngine(CopyEngine):
    """The CUDA protocol on CPU threads: one thread per queue, futures as events.

    delay: seconds every queued copy sleeps before it runs, to mimic a slow link; a reader that
    forgot to wait then sees the buffer's old rows."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self.delay = delay
        self._write_queue = ThreadPoolExecutor(1, thread_name_prefix="infinigen-d2h")
        self._copy_queue = ThreadPoolExecutor(1, thread_name_prefix="infinigen-h2d")

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def compute_marker(self):
        done: Future = Future()
        done.set_result(None)  # CPU compute has finished when the call that issued it returned
        return done

    def _run(self, queue: ThreadPoolExecutor, fn, after, keepalive) -> Future:
        def job(keep=keepalive):  # `keep`: what the copy reads lives until it ran
            if after is not None:
                after.result()
            if self.delay:
                time.sleep(self.delay)
            fn()

        return queue.submit(job)

    def write(self, fn, after, keepalive=()):
        return self._run(self._write_queue, fn, after, keepalive)

    def copy(self, fn, keepalive=()):
        return self._run(self._copy_queue, fn, None, keepalive)

    def host_wait(self, marker):
        marker.result()

    def device_wait(self, marker):
        marker.result()  # the CPU "device" is the host

    def close(self):
        self._write_queue.shutdown(wait=True)
        self._copy_queue.shutdown(wait=True)


COPY_ENGINES = ("auto", "cuda", "threads")


def new_copy_engine(kind: str, device: torch.device | str | None) -> CopyEngine:
    """The engine for `kind`: ``cuda`` (the device must be CUDA), ``threads`` (CPU emulation),
    ``auto`` (cuda when the compute device is a CUDA device, else refused: a CPU compute device
    gains nothing from pinned memory; say ``threads`` to run the protocol anyway)."""
    device = torch.device(device) if device is not None else None
    if kind == "threads":
        return ThreadCopyEngine()
    if kind == "auto" and (device is None or device.type != "cuda"):
        raise RuntimeError(
            "the pinned tier needs a CUDA device; use tier='ram' or tier='disk' on this machine "
            "(or copy_engine='threads' to run the pinned tier's protocol on CPU threads)"
        )
    if kind not in ("auto", "cuda"):
        raise ValueError(f"copy_engine must be one of {COPY_ENGINES}, got {kind!r}")
    return CudaCopyEngine(device if device is not None else "cuda")
