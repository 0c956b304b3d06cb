"""Per-layer cache objects, in the style of transformers' own cache layers: `update` does the work.

`ComputeLayer`  the whole KV of a layer stays with the compute, in a preallocated buffer.
`LocalLayer`    a sliding-window layer: only the last `window` - 1 positions stay, with the
                 compute (transformers' own sliding-layer semantics, so its masks apply).
`OffloadedLayer` the whole KV lives in a slow tier; each decode step reads back every row
                 (no selector) or the rows its selector chooses, issued one layer ahead when the
                 selector can choose from the previous layer's input, so the transfer overlaps
                 that layer's compute. It owns its tier, its selector state, its transfer in
                 flight and its counters.

Both answer the session's hooks: `own_input` (this layer's normalized attention input arrived),
`previous_input` (the previous layer's did), and `attend` (the attention call itself).
"""

from __future__ import annotations

import functools
import math
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from infinigen.attention import attend_selection, attend_selection_output, dense_attention
from infinigen.select import Selector
from infinigen.speculate import PrefillAttention, Selection, all_valid, attention_recall
from infinigen.storage import KVTier, PooledTier, Storage
from infinigen.storage.base import done_future


class Positions:
    """Which cached positions are real tokens (left padding is not), shared by every layer of a
    cache. A forward describes its new tokens (`describe`); positions no forward described (a
    cache filled by calling `update` directly) count as real."""

    def __init__(self) -> None:
        self._valid: torch.Tensor | None = None  # [B, n]
        self.padded = False  # whether any described position is padding

    def describe(self, start: int, valid: torch.Tensor) -> None:
        """valid [B, q]: which of the positions start .. start + q - 1 are real tokens."""
        b, q = valid.shape
        self._grow(b, start + q, valid.device)
        self._valid[:, start : start + q] = valid
        self.padded = self.padded or not bool(valid.all())

    def upto(self, batch: int, length: int, device) -> torch.Tensor:
        """[B, length] bool: the real tokens among the first `length` positions."""
        self._grow(batch, length, device)
        return self._valid[:, :length].to(device)

    def _grow(self, batch: int, length: int, device) -> None:
        have = 0 if self._valid is None else self._valid.shape[1]
        if self._valid is not None and self._valid.shape[0] != batch:
            raise ValueError(f"the cache holds a batch of {self._valid.shape[0]}, got {batch}")
        if length > have:
            grown = torch.ones(batch, max(length, 2 * have), dtype=torch.bool, device=device)
            if self._valid is not None:
                grown[:, :have] = self._valid
            self._valid = grown


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
    """Decode-time statistics of one layer."""

    steps: int = 0
    fraction_sum: float = 0.0
    recall_sum: float = 0.0
    recall_n: int = 0
    wait_seconds: float = 0.0
    evictions: int = 0  # a capped pool's, kept when its tier is closed
    pool_slots: int = 0
    correction_rows: int = 0  # rows fetched as top-ups (speculate, then correct)

    def fraction(self) -> float | None:
        return float(self.fraction_sum) / self.steps if self.steps else None

    def recall(self) -> float | None:
        return self.recall_sum / self.recall_n if self.recall_n else None


class SessionLayer(CacheLayerMixin):
    """What every layer a session drives shares: transformers' per-layer bookkeeping (its length
    is `length`) and the session's hooks, which do nothing unless a layer needs them."""

    is_compileable = False
    is_sliding = False
    length: int = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def own_input(self, x: torch.Tensor, position_embeddings) -> None:
        """This layer's normalized attention input arrived."""

    def previous_input(self, x: torch.Tensor, position_embeddings) -> None:
        """The previous layer's normalized attention input arrived."""

    def attend(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """The attention call over what `update` returned: the model's own, by default."""
        return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class ComputeLayer(SessionLayer):
    """A layer whose whole KV stays with the compute: a preallocated buffer grown by doubling
    (never past `capacity`), written in place, so a decode step copies nothing it already holds."""

    role = "compute"

    def __init__(self, index: int, capacity: int, reserve: bool = False) -> None:
        """capacity: the most positions it will hold; reserve: allocate all of them at the first
        update (the cache knows the generation's length) instead of growing from the prompt."""
        super().__init__()
        self.index, self.capacity, self.reserve = index, capacity, reserve
        self.length = 0
        self.stats = LayerStats()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        end = self.length + n
        have = 0 if self._k is None else self._k.shape[2]
        if end > have:
            if have == 0:
                size = max(end, self.capacity) if self.reserve else end
            else:
                size = max(end, min(2 * have, self.capacity))
            k = key_states.new_empty(*key_states.shape[:2], size, key_states.shape[3])
            v = value_states.new_empty(*value_states.shape[:2], size, value_states.shape[3])
            if have:
                k[:, :, : self.length] = self._k[:, :, : self.length]
                v[:, :, : self.length] = self._v[:, :, : self.length]
            self._k, self._v = k, v
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def close(self) -> None:
        self._k = self._v = self.keys = self.values = None


class LocalLayer(SessionLayer):
    """A sliding-window (local) layer: it keeps the last `window` - 1 positions with the compute
    and returns them followed by the new ones, exactly as transformers' `DynamicSlidingWindowLayer`
    does, and reports the same mask sizes, so that the model's own sliding-window mask decides
    what each query sees. Its KV is bounded by the window whatever the context: never offloaded,
    never speculated.

    keys, values: KV it starts from (an evaluation's prefix, already trimmed to its window),
    `length` positions long in all."""

    role = "local"
    is_sliding = True

    def __init__(
        self,
        index: int,
        window: int,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        length: int = 0,
    ) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"a local layer needs a window of at least 1 position, got {window}")
        self.index, self.window, self.length = index, window, length
        self.stats = LayerStats()
        self.peak_bytes = 0  # the most KV bytes it held after an update
        if keys is not None:
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        full_k = torch.cat([self.keys, key_states], dim=-2)
        full_v = torch.cat([self.values, value_states], dim=-2)
        start = max(full_k.shape[2] - (self.window - 1), 0)
        self.keys, self.values = full_k[:, :, start:], full_v[:, :, start:]
        if key_states.shape[2] > 1:  # a prefill: keep the window, not a view of the whole prompt
            self.keys, self.values = self.keys.clone(), self.values.clone()
        self.length += key_states.shape[2]
        self.peak_bytes = max(self.peak_bytes, 2 * self.keys.numel() * self.keys.element_size())
        return full_k, full_v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv length, kv offset) of what `update` will return, as the sliding mask needs them."""
        offset = max(self.length - self.window + 1, 0)
        return min(self.length, self.window - 1) + query_length, offset

    def get_max_length(self) -> int:
        return self.window

    def close(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False


class RowBuffers:
    """Where transfers land: [B, Hkv, >= rows, d] buffers in the compute dtype, written once by
    the tier (converted where the rows land) and then by the new token, so that a step copies
    each row once; grown by doubling. Layers of one cache share two pairs, by the parity of their
    index: layer i's transfer is issued during layer i - 1 and read by layer i's attention,
    after which layer i + 2 may reuse them. Slots a ragged selection leaves unused hold finite
    stale rows, which attention masks out. A model split across devices gets two pairs per
    device: a layer's buffers live where it computes."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def room(self, layer: int, like: KVTier, rows: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer % 2, str(torch.device(device)))
        pair = self._pairs.get(key)
        have = 0 if pair is None else pair[0].shape[2]
        same_kind = pair is not None and pair[0].dtype == dtype and pair[0].shape[:2] == (like.batch, like.kv_heads)
        if not same_kind or rows > have:
            shape = (like.batch, like.kv_heads, max(rows, 2 * have if same_kind else 0), like.head_dim)
            k = torch.zeros(shape, dtype=dtype, device=device)
            v = torch.zeros_like(k)
            if same_kind:  # what is held stays (a fetch may already have landed)
                k[:, :, :have], v[:, :, :have] = pair
            pair = self._pairs[key] = (k, v)
        return pair


@dataclass
class _InFlight:
    selects: bool  # the transfer delivers (selection, tier transfer, fraction); else every position's rows
    transfer: Future
    issued_at: int

    def settle(self) -> None:
        """Wait until nothing of this transfer is still reading the tier."""
        done = self.transfer.result()
        if self.selects:
            done[1].result()


@dataclass(eq=False)
class OffloadedLayer(SessionLayer):
    """A layer whose whole KV lives in a slow tier (see the module docstring).

    role:     ``fetch_all`` (every row, every decode step) or ``select`` (the selector's rows);
    adapter:  computes this layer's query from a normalized input (for selectors that need one);
    storage:  builds the tier at the first update; positions: which cached positions are real.
    """

    index: int
    role: str
    adapter: Any
    storage: Storage
    positions: Positions
    counters: CacheCounters
    selector: Selector | None = None
    pooled: bool = False
    measure_recall: bool = False
    prefetch: Executor | None = None  # the cache's prefetch thread (None: select and fetch inline)
    buffers: RowBuffers = field(default_factory=RowBuffers)  # shared by the layers of a cache
    tier: KVTier | None = None
    length: int = 0
    stats: LayerStats = field(default_factory=LayerStats)

    def __post_init__(self) -> None:
        CacheLayerMixin.__init__(self)
        if self.role == "fetch_all":
            self.selector = None
        self.state = self.selector.new_state(self.index) if self.selector is not None else None
        self._in_flight: _InFlight | None = None
        self._selection: Selection | None = None  # what the current step attends ...
        self._attend_valid: torch.Tensor | None = None  # ... as a mask over (rows, current token)

    # ------------------------------------------------------------------ the session's hooks
    def own_input(self, x: torch.Tensor, position_embeddings) -> None:
        """This layer's input arrived: issue what nobody issued ahead (layer 0, or a selector
        that needs this layer's own query)."""
        if self._decoding(x) and self._in_flight is None:
            self._issue(x, position_embeddings, issued_at=self.index)

    def previous_input(self, x: torch.Tensor, position_embeddings) -> None:
        """The previous layer's input arrived: issue this layer's transfer now, so that it runs
        while the previous layer computes — unless the selector needs this layer's own query."""
        own_query = self.selector is not None and self.selector.query_from == "own"
        if self._decoding(x) and self._in_flight is None and not own_query:
            self._issue(x, position_embeddings, issued_at=self.index - 1)

    def _decoding(self, x: torch.Tensor) -> bool:
        return x.shape[1] == 1 and self.length > 0 and self.tier is not None

    @torch.no_grad()
    def _issue(self, x: torch.Tensor, position_embeddings, issued_at: int) -> None:
        """Start this layer's transfer for the coming step. Issued ahead (from the previous
        layer's input), the selection and the fetch run on the cache's prefetch thread while the
        compute thread goes on with the previous layer; issued at the layer itself, they run now."""
        past = self.length
        if self.selector is None:
            transfer = self.tier.read_all_async(past, self.device, self.dtype, out=self._room(past + 1))
            self._in_flight = _InFlight(False, transfer, issued_at)
            if self.counters.trace is not None:
                self.counters.trace.append(TransferRecord(self.index, issued_at, past, None))
            return
        job = functools.partial(self._select_and_fetch, x, position_embeddings, past, self._valid(past), issued_at)
        ahead = issued_at < self.index and self.prefetch is not None
        self._in_flight = _InFlight(True, self.prefetch.submit(job) if ahead else done_future(job), issued_at)

    @torch.no_grad()
    def _select_and_fetch(self, x: torch.Tensor, position_embeddings, past: int, valid: torch.Tensor, issued_at: int):
        """Ask the selector, then fetch its rows into this layer's buffers: (selection, (k, v))."""
        start = time.perf_counter()
        query = None
        if self.selector.query_from is not None:
            if x.device != self.device:  # the previous layer computes on another device
                x = x.to(self.device)
                if position_embeddings is not None:
                    position_embeddings = tuple(t.to(self.device) for t in position_embeddings)
            xf = x if x.dtype == torch.float32 else x.to(torch.float32)
            query = self.selector.query(self.index, xf, position_embeddings)[:, :, -1]
        selection = self.selector.select(self.state, self.index, query, past, valid)
        self.counters.speculation_seconds += time.perf_counter() - start
        if self.counters.trace is not None:
            self.counters.trace.append(TransferRecord(self.index, issued_at, past, selection))
        out = self._room(selection.indices.shape[2] + 1)
        transfer = self.tier.gather_async(selection.indices, selection.valid, self.device, self.dtype, out=out)
        # The compute thread waits on `transfer` (a device transfer orders that thread's stream).
        return selection, transfer, float(self._fraction(selection, past))

    def _room(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's transfer buffers with room for `rows` (see `RowBuffers`)."""
        return self.buffers.room(self.index, self.tier, rows, self.dtype, self.device)

    def _valid(self, past: int) -> torch.Tensor:
        """[B, Hkv, past]: the positions that exist for each KV head (real, still stored);
        `all_valid` when every one does (no padding, no capped pool), which costs nothing."""
        b, hkv = self.tier.batch, self.tier.kv_heads
        present = self.tier.present(past)
        if present is None and not self.positions.padded:
            return all_valid(b, hkv, past, self.device)
        valid = self.positions.upto(b, past, self.device)[:, None, :].expand(b, hkv, past)
        return valid if present is None else valid & present.to(valid.device)

    # ------------------------------------------------------------------ transformers' layer API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new KV and return what this step attends: the rows read back (waited on
        here, and only here) followed by the new positions; at the prefill, the new KV itself."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, hkv, n, d = key_states.shape
        past = self.length
        self._selection = self._attend_valid = None
        # Resolve this layer's transfer before the tier is written (it is never written while read).
        in_flight, self._in_flight = self._in_flight, None
        if past > 0 and (n > 1 or in_flight is None):  # a prefill chunk after the first, or nothing issued
            if in_flight is not None:
                in_flight.settle()
            transfer = self.tier.read_all_async(past, self.device, self.dtype, out=self._room(past + n))
            in_flight = _InFlight(False, transfer, self.index)
        fetched = self._wait(in_flight.transfer) if past > 0 else None
        selection = fraction = None
        if in_flight is not None and in_flight.selects:
            selection, transfer, fraction = fetched
            fetched = self._wait(transfer)

        if self.tier is None:
            self.tier = self.storage.new_tier(
                b, hkv, d, key_states.dtype, pooled=self.pooled, positions=n, device=key_states.device
            )
        new_valid = self.positions.upto(b, past + n, key_states.device)[:, past:]
        self.tier.append(key_states, value_states, new_valid)
        if self.selector is not None:
            self.selector.on_append(self.state, self.index, key_states, new_valid)
        self.length += n

        if fetched is None:
            return key_states, value_states  # prefill: dense, from the freshly computed KV
        m = fetched[0].shape[2]
        if selection is not None:
            self._selection = selection
            self._attend_valid = torch.cat([selection.valid, selection.valid.new_ones(b, hkv, n)], -1)
            self._count_step(fraction)
        elif n == 1:
            self._count_step(1.0)
        k_rows, v_rows = self._room(m + n)  # the fetched rows are its first m slots already
        k_rows[:, :, m : m + n] = key_states
        v_rows[:, :, m : m + n] = value_states
        return k_rows[:, :, : m + n], v_rows[:, :, : m + n]

    def attend(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if self._attend_valid is None:
            if query.shape[2] > 1 and self.selector is not None:  # a prefill: the selector may want its weights
                sc = query.shape[-1] ** -0.5 if scaling is None else scaling
                valid = self.positions.upto(query.shape[0], key.shape[2], query.device)
                self.selector.on_prefill(self.state, self.index, PrefillAttention(query, key, valid, sc))
            return dense_attention(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        sc = query.shape[-1] ** -0.5 if scaling is None else scaling
        key, value = self._correct(query, key, value)
        if self.selector.observes:
            out, probs = attend_selection(query, key, value, self._attend_valid, sc)
            p = probs[:, :, -1]
            self.selector.observe(self.state, self.index, self._selection, p[..., :-1], p[..., -1])
        else:
            out = attend_selection_output(query, key, value, self._attend_valid, sc)
        if self.measure_recall and self.tier.present(self.length) is None:
            self._record_recall(query, sc)
        return out, None

    def _correct(self, query, key, value):
        """Speculate, then correct: the selector may add positions chosen with this layer's own
        query; they are fetched now (a second transfer, not overlapped: its time is the
        correction's), placed after the first transfer's rows, and attended with them."""
        past = self.length - 1
        start = time.perf_counter()
        valid = self._valid(past)
        extra = self.selector.correct(self.state, self.index, query[:, :, -1], past, valid, self._selection)
        if extra is None or extra.indices.shape[-1] == 0:
            return key, value
        k_x, v_x = self.tier.gather_async(extra.indices, extra.valid, self.device, self.dtype).result()
        m = self._selection.indices.shape[-1]
        key = torch.cat([key[:, :, :m], k_x.to(key.dtype), key[:, :, m:]], 2)
        value = torch.cat([value[:, :, :m], v_x.to(value.dtype), value[:, :, m:]], 2)
        sel = self._selection
        self._selection = Selection(
            torch.cat([sel.indices, extra.indices], -1), torch.cat([sel.valid, extra.valid], -1)
        )
        new = self._attend_valid[..., m:]
        self._attend_valid = torch.cat([self._selection.valid, new], -1)
        rows = int(extra.valid.sum())
        self.stats.correction_rows += rows
        self.stats.fraction_sum += float(self._fraction(extra, past))  # the step fetched these too
        self.counters.correction_bytes += rows * self.tier.row_bytes
        self.counters.correction_seconds += time.perf_counter() - start
        return key, value

    # ------------------------------------------------------------------ bookkeeping
    def _wait(self, transfer: Future) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        out = transfer.result()
        waited = time.perf_counter() - start
        self.stats.wait_seconds += waited
        self.counters.wait_seconds += waited
        return out

    def _fraction(self, selection: Selection, past: int) -> torch.Tensor:
        """Mean over (batch, KV head) rows of selected / real context (computed on the prefetch
        thread, whose host sync costs the compute nothing)."""
        if not self.positions.padded:
            return selection.counts.to(torch.float64).mean() / max(past, 1)
        context = self.positions.upto(selection.valid.shape[0], past, selection.valid.device).sum(-1)
        ctx = context.clamp(min=1).to(torch.float64)[:, None]
        return (selection.counts.to(torch.float64) / ctx).mean()

    def _count_step(self, fraction: float) -> None:
        self.stats.steps += 1
        self.stats.fraction_sum += fraction

    def _record_recall(self, query: torch.Tensor, scaling: float) -> None:
        """Attention mass of the selection under the true (dense) attention — evaluation only."""
        k_all, _ = self.tier.peek_all()
        past = self.length - 1
        h = query.shape[1]
        k = k_all[:, :, :past].to(query.device, torch.float32).repeat_interleave(h // k_all.shape[1], dim=1)
        # Softmax over all cached positions and the current token; recall counts cached ones only.
        scores = torch.matmul(query[:, :, -1:].to(torch.float32), k.transpose(-1, -2))[:, :, 0] * scaling
        real = self.positions.upto(query.shape[0], past, query.device)
        probs = torch.softmax(scores.masked_fill(~real[:, None, :], -math.inf), dim=-1)
        self.stats.recall_sum += attention_recall(probs, self._selection).mean().item()
        self.stats.recall_n += 1

    def close(self) -> None:
        """Wait for the transfer in flight and release the tier (remove its file)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            try:
                in_flight.settle()
            except Exception:
                pass
        if self.tier is not None:
            self.stats.evictions, self.stats.pool_slots = self.pool_counts()
            self.tier.close()
            self.tier = None

    def pool_counts(self) -> tuple[int, int]:
        """(positions evicted, rows the capped host pool holds); zeros without a pool."""
        if self.tier is None:
            return self.stats.evictions, self.stats.pool_slots
        slots = self.tier.capacity * self.tier.batch * self.tier.kv_heads if isinstance(self.tier, PooledTier) else 0
        return self.tier.evictions, slots
