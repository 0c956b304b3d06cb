"""A tensor that grows along one dimension without re-copying what it holds on every append.

Decode appends one position per step to many per-layer tensors (the KV with the compute, the
partial keys, the oracle's key copy, Quest's page bounds). `torch.cat` re-copies the whole
tensor each time, O(T) per step; this buffer writes in place and grows its allocation by a quarter
(at least 64 positions) when full, so the copies still amortize to O(1) per append while the space
held beyond what is filled stays under a quarter: doubling would, at the first decode step after
an 8K prefill, hold room for 16K positions. One implementation serves every such tensor.
"""

from __future__ import annotations

import torch

GROWTH_MIN = 64  # positions added at least when a buffer grows


def grown_size(have: int, need: int, limit: int | None = None) -> int:
    """The one growth rule of every buffer that grows: room for `need` positions when `have` are
    allocated, a quarter more than `have` (at least `GROWTH_MIN`), never beyond `limit`."""
    size = max(need, have + max(have // 4, GROWTH_MIN))
    return size if limit is None else max(need, min(size, limit))


class GrowingTensor:
    """`dim` grows; every other dimension is fixed by the first append.

    capacity: positions to allocate at the first append (at least what it holds); `fill`: the value
    of allocated positions not written yet (what a reader of `full` sees there). `data` is a view of the
    filled part: valid until the next append that grows the buffer.
    """

    def __init__(self, dim: int = -1, capacity: int = 0, fill: float = 0.0) -> None:
        self.dim, self.capacity, self.fill = dim, capacity, fill
        self.length = 0
        self._buf: torch.Tensor | None = None

    @property
    def data(self) -> torch.Tensor | None:
        """The filled part (a view), or None before the first append."""
        return None if self._buf is None else self._buf.narrow(self.dim, 0, self.length)

    @property
    def nbytes(self) -> int:
        """Bytes allocated (spare capacity included): what this buffer holds in memory."""
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()

    @property
    def full(self) -> torch.Tensor | None:
        """The whole allocated buffer (positions beyond `length` hold `fill`)."""
        return self._buf

    def reserve(self, like: torch.Tensor, size: int) -> None:
        """Room for `size` positions shaped as `like` elsewhere; keeps what it holds."""
        have = 0 if self._buf is None else self._buf.shape[self.dim]
        if size <= have:
            return
        shape = list(like.shape)
        shape[self.dim] = size
        buf = torch.full(shape, self.fill, dtype=like.dtype, device=like.device)
        if self._buf is not None and self.length:
            buf.narrow(self.dim, 0, self.length).copy_(self.data)
        self._buf = buf

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Write `x` after what is held (growing by a quarter); returns the filled part."""
        n = x.shape[self.dim]
        start = self.length
        self.claim(n, x)
        self._buf.narrow(self.dim, start, n).copy_(x)
        return self.data

    def claim(self, n: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """Room for `n` positions after what is held (growing by a quarter), counted as held, for a
        writer that fills `full` in place; returns `full`. `like` shapes the first allocation
        (afterwards the buffer shapes its own growth)."""
        end = self.length + n
        have = 0 if self._buf is None else self._buf.shape[self.dim]
        if end > have:
            self.reserve(like if self._buf is None else self._buf, max(self.capacity, grown_size(have, end)))
        self.length = end
        return self._buf

    def clear(self) -> None:
        self._buf, self.length = None, 0
