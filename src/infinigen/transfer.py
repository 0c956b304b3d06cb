"""One offloaded layer's transfers and what they count.

`Transfer`      the rows of one layer for one step on their way from the slow tier: issued (on the
                cache's prefetch thread while the previous layer computes, or now), settled (nothing
                of it still reads the tier) and waited on by the compute, which is the stall counted.
`RowBuffers`    where the rows land, on the compute's side.
`Recorder`      a layer's counters and the cache's totals, written together.
`fetched_fraction` the one rule for the fraction of the context a selection fetches, shared by the
                runtime and the forced evaluator.

The tier counts bytes, rows and requests itself (`TransferStats`); what is counted here is what
only the layer knows: waits, steps and their fractions, the correction's top-ups, the trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from infinigen.growing import grown_size
from infinigen.speculate import Selection
from infinigen.storage import KVTier
from infinigen.storage.base import done_future

Rows = tuple[torch.Tensor, torch.Tensor]


def fetched_fraction(selection: Selection, context: int | torch.Tensor) -> torch.Tensor:
    """Mean over (batch, KV head) of selected / real context: `context` is the past's length when
    every position is a real token, else [B] real tokens per batch row. A float64 tensor (the
    host sync is left to the caller: the runtime makes it on the prefetch thread)."""
    counts = selection.counts.to(torch.float64)
    if isinstance(context, int):
        return counts.mean() / max(context, 1)
    return (counts / context.clamp(min=1).to(torch.float64)[:, None]).mean()


@dataclass
class Planned:
    """What issuing a transfer starts: the tier's read in flight and, for a selection, which
    positions it reads and the fraction of the context they make (every row: 1.0)."""

    rows: Future  # of (k, v), written into the layer's buffers
    selection: Selection | None = None
    fraction: float = 1.0


@dataclass
class Fetched:
    """A transfer waited on: the rows (views of the layer's buffers), what they are, the stall."""

    rows: Rows
    selection: Selection | None
    fraction: float
    waited: float  # seconds the compute thread blocked on it


class Transfer:
    """The rows of one layer for one decode step, from the moment they are asked for until the
    compute has them. `work` resolves to a `Planned`: for a selector, its selection is made first
    (on the prefetch thread when issued one layer ahead), then the tier's gather is started."""

    def __init__(self, work: Future, issued_at: int) -> None:
        self.work = work
        self.issued_at = issued_at  # the layer whose input issued it

    @classmethod
    def issue(cls, plan: Callable[[], Planned], issued_at: int, executor: Executor | None) -> Transfer:
        """Run `plan` (select, then start the gather) on `executor`, the cache's prefetch thread,
        so that it overlaps the compute; or now, when there is none."""
        return cls(executor.submit(plan) if executor is not None else done_future(plan), issued_at)

    @classmethod
    def every_row(cls, tier: KVTier, past: int, device, dtype, out: Rows | None, issued_at: int) -> Transfer:
        """A read of the first `past` rows into `out`, started now."""
        rows = tier.read_all_async(past, device, dtype, out=out)
        return cls(done_future(Planned, rows), issued_at)

    @classmethod
    def chunk(
        cls, tier: KVTier, start: int, stop: int, device, dtype, out: Rows | None, issued_at: int, fraction: float = 1.0
    ) -> Transfer:
        """A read of positions [start, stop) of every row into `out` (None: new tensors), started
        now, through the tier's sequential read: a chunk of a layer read in chunks (its step
        reads every row, fraction 1), or a sliding window (`fraction`: the window's share of
        the past)."""
        rows = tier.read_range_async(start, stop, device, dtype, out=out)
        return cls(done_future(Planned, rows, None, fraction), issued_at)

    def settle(self) -> None:
        """Wait, uncounted, until nothing of this transfer still reads the tier: before the tier
        is read anew, written or closed."""
        self.work.result().rows.result()

    def wait(self) -> Fetched:
        """Block until the rows are in the buffers (the only place the compute waits on them);
        the seconds blocked are the step's stall on this layer."""
        start = time.perf_counter()
        planned = self.work.result()
        rows = planned.rows.result()
        return Fetched(rows, planned.selection, planned.fraction, time.perf_counter() - start)


class RowBuffers:
    """Where transfers land: [B, Hkv, >= rows, d] buffers, written once by the tier and grown by
    the one growth rule (`growing.grown_size`). Two kinds: a selection's rows (and a chunk of every row) in the dtype the tier
    stores them in, attended as they are and widened a slice at a time; and every row of a layer
    read whole (`whole`), in the compute dtype, followed by the new token, which the model's own
    attention takes. Layers of one cache share two pairs of each kind, by the parity of their
    index: layer i's transfer is issued during layer i - 1 and read by layer i's attention,
    after which layer i + 2 may reuse them. Slots a ragged selection leaves unused hold finite
    stale rows, which attention masks out. A model split across devices gets its pairs per
    device: a layer's buffers live where it computes."""

    def __init__(
        self, reserve: tuple[int, int] = (0, 0), chunk: int = 0, reserve_whole: tuple[int, int] = (0, 0)
    ) -> None:
        """reserve, reserve_whole: rows to make room for at the first use of each kind, by the
        parity of the layer (the most a step of the planned generation reads there,
        `budget.transfer_rows`), so that the buffers never grow. chunk: the positions a layer
        read in chunks reads at a time (`fetch_chunk`): such a layer attends one chunk from its
        parity's pair while the next lands in a second pair of that parity (`second=True`), which
        holds one chunk."""
        self._pairs: dict[tuple[int, bool, bool, str], Rows] = {}
        self.reserve, self.chunk, self.reserve_whole = reserve, chunk, reserve_whole

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._pairs.values())

    @staticmethod
    def planned_bytes(
        stored: tuple[int, int],
        whole: tuple[int, int],
        second: tuple[int, int],
        slot: int,
        rows_dtype: torch.dtype,
        compute_dtype: torch.dtype,
    ) -> int:
        """What the buffers hold when reserved as planned: by parity, `stored` rows in the tier's
        dtype, `whole` rows in the compute dtype, and `second`, the chunk a layer read in chunks
        lands in its second pair; `slot`: the elements of one row slot, K and V."""
        rows = sum(stored) + sum(second)
        return slot * (rows * rows_dtype.itemsize + sum(whole) * compute_dtype.itemsize)

    def pair(
        self, layer: int, like: KVTier, rows: int, dtype, device, second: bool = False, whole: bool = False
    ) -> Rows:
        key = (layer % 2, second, whole, str(torch.device(device)))
        pair = self._pairs.get(key)
        have = 0 if pair is None else pair[0].shape[2]
        same_kind = pair is not None and pair[0].dtype == dtype and pair[0].shape[:2] == (like.batch, like.kv_heads)
        if not same_kind or rows > have:
            reserve = (self.reserve_whole if whole else self.reserve)[layer % 2]
            size = max(rows, self.chunk) if second else (grown_size(have, rows) if same_kind else max(rows, reserve))
            shape = (like.batch, like.kv_heads, size, like.head_dim)
            k = torch.zeros(shape, dtype=dtype, device=device)
            v = torch.zeros_like(k)
            if same_kind:  # what is held stays (a fetch may already have landed)
                k[:, :, :have], v[:, :, :have] = pair
            pair = self._pairs[key] = (k, v)
        return pair


# ---------------------------------------------------------------------- counting
@dataclass
class TransferRecord:
    """One transfer issued for a decode step (kept when the cache is made with trace=True):
    the layer it is for, the layer whose input issued it, the context it covers, and the
    selection (None: every row)."""

    layer: int
    issued_at: int
    past: int
    selection: Selection | None


@dataclass
class CacheCounters:
    """What the layers of one cache count together."""

    decode_steps: int = 0
    prefill_tokens: int = 0
    batch: int = 0
    speculation_seconds: float = 0.0
    wait_seconds: float = 0.0
    correction_seconds: float = 0.0  # choosing and fetching the top-ups (speculate, then correct)
    correction_bytes: int = 0
    trace: list[TransferRecord] | None = None


@dataclass
class LayerStats:
    """Decode-time statistics of one layer (the forced evaluator keeps the same per layer)."""

    steps: int = 0
    fraction_sum: float = 0.0
    wait_seconds: float = 0.0
    evictions: int = 0  # a capped pool's, kept when its tier is closed
    pool_slots: int = 0
    correction_rows: int = 0  # rows fetched as top-ups (speculate, then correct)

    def fraction(self) -> float | None:
        return float(self.fraction_sum) / self.steps if self.steps else None

    def count_step(self, fraction: float) -> None:
        """A decode step that read `fraction` of the context."""
        self.steps += 1
        self.fraction_sum += fraction

    def count_top_up(self, rows: int, fraction: float) -> None:
        """The step also read a top-up: `rows` more, `fraction` more of the context."""
        self.correction_rows += rows
        self.fraction_sum += fraction


@dataclass
class Recorder:
    """What an offloaded layer counts, written to its own statistics and the cache's totals at
    once, so that the totals are the layers' sums."""

    layer: int
    cache: CacheCounters
    stats: LayerStats = field(default_factory=LayerStats)

    def issued(self, issued_at: int, past: int, selection: Selection | None) -> None:
        if self.cache.trace is not None:
            self.cache.trace.append(TransferRecord(self.layer, issued_at, past, selection))

    def speculated(self, seconds: float) -> None:
        self.cache.speculation_seconds += seconds

    def waited(self, seconds: float) -> None:
        self.stats.wait_seconds += seconds
        self.cache.wait_seconds += seconds

    def topped_up(self, rows: int, fraction: float, nbytes: int, seconds: float) -> None:
        self.stats.count_top_up(rows, fraction)
        self.cache.correction_bytes += nbytes
        self.cache.correction_seconds += seconds
