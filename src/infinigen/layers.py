"""Per-layer cache objects, in the style of transformers' own cache layers: `update` does the work.

`ComputeLayer`  the whole KV of a layer stays with the compute, in a preallocated buffer.
`LocalLayer`    a sliding-window layer: only the last `window` - 1 positions stay, with the
                 compute (transformers' own sliding-layer semantics, so its masks apply).
`OffloadedLayer` the whole KV lives in a slow tier; each decode step reads back every row,
                 issued one layer ahead, so the transfer overlaps that layer's compute. Its
                 verbs: issue the transfer, wait on it, append, attend (`transfer.py` has the
                 transfer and the counters).
`SelectingLayer` an offloaded layer that reads the rows its selector chooses, issued one
                 layer ahead when the selector can choose from the previous layer's input
                 (`layer_selector.py` has the selector's calls).
`WindowLayer`   a sliding-window layer offloaded as well: each step reads back its window.

All answer the session's hooks: `own_input` (this layer's normalized attention input arrived),
`previous_input` (the previous layer's did), and `attend` (the attention call itself).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin

import infinigen.kernels as kernels
from infinigen.attention import (
    attend_in_chunks,
    attend_stored,
    attention_scaling,
    dense_attention,
    key_validity,
)
from infinigen.growing import grown_size
from infinigen.layer_selector import LayerSelector, with_top_up
from infinigen.roles import Role
from infinigen.select import Selector
from infinigen.speculate import PrefillAttention, Selection, all_valid, is_all_valid
from infinigen.storage import KVTier, PooledTier, Storage
from infinigen.storage.base import done_future
from infinigen.transfer import (
    CacheCounters,
    Fetched,
    LayerStats,
    Planned,
    Recorder,
    RowBuffers,
    Rows,
    Transfer,
    fetched_fraction,
)

IN_PLACE = ("in place",)  # a transfer that moved nothing: the attention reads the rows in the tier


def reads_in_place(tier: str, fmt: str, pooled: bool, observes: bool, head_dim: int, device_type: str) -> bool:
    """Whether a selecting layer attends its chosen rows where the tier keeps them, with no
    transfer buffer (the one rule: the layers and the memory planner ask it): host memory beside
    a CPU compute, rows stored as they are (no pool's slots, no packed format), a selector that
    needs no weights back, and the kernels built for this head dim."""
    return (
        tier == "ram"
        and fmt == "native"
        and not pooled
        and not observes
        and device_type == "cpu"
        and kernels.attend_reads(head_dim)
    )


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

    @property
    def nbytes(self) -> int:
        return 0 if self._valid is None else self._valid.nbytes

    @staticmethod
    def planned_bytes(batch: int, positions: int) -> int:
        """The most it holds for a generation reaching `positions`: one bool a position, grown
        by the one rule from wherever it stood."""
        return batch * grown_size(positions - 1, positions)

    def upto(self, batch: int, length: int, device) -> torch.Tensor:
        """[B, length] bool: the real tokens among the first `length` positions."""
        self._grow(batch, length, device)
        return self._valid[:, :length].to(device)

    def _grow(self, batch: int, length: int, device) -> None:
        have = 0 if self._valid is None else self._valid.shape[1]
        if self._valid is not None and self._valid.shape[0] != batch:
            raise ValueError(f"the cache holds a batch of {self._valid.shape[0]}, got {batch}")
        if length > have:
            grown = torch.ones(batch, grown_size(have, length), dtype=torch.bool, device=device)
            if self._valid is not None:
                grown[:, :have] = self._valid
            self._valid = grown


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


def _widened(stored: torch.Tensor, new: torch.Tensor, past: int) -> torch.Tensor:
    """The first `past` positions of `stored` in `new`'s dtype, followed by `new` as computed:
    one tensor, each position written once."""
    out = new.new_empty(*new.shape[:2], past + new.shape[2], new.shape[3])
    out[:, :, :past].copy_(stored[:, :, :past])
    out[:, :, past:] = new
    return out


class ComputeLayer(SessionLayer):
    """A layer whose whole KV stays with the compute: a preallocated buffer grown by the one
    growth rule (`growing.grown_size`, never past `capacity`), written in place, so a decode step copies nothing it already holds.

    Stored in `store_dtype` when given (the KV's storage dtype: 16 bits where the model computes
    in float32, half the bytes kept), a decode step of a session's forward attends the past as
    stored, widened a slice at a time (`attention.attend_stored`), and its own K and V as
    computed; any other call of `update` (a prefill, transformers' own use) gets the past widened
    whole, followed by the new positions. The first forward attends its own KV as computed, as
    offloaded layers do."""

    role = Role.COMPUTE

    def __init__(
        self, index: int, capacity: int, reserve: bool = False, store_dtype: torch.dtype | None = None
    ) -> None:
        """capacity: the most positions it will hold; reserve: allocate all of them at the first
        update (the cache knows the generation's length) instead of growing from the prompt."""
        super().__init__()
        self.index, self.capacity, self.reserve, self.store_dtype = index, capacity, reserve, store_dtype
        self.length = 0
        self.stats = LayerStats()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._session_step = False  # a session's decode forward reached this layer (`own_input`)
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None  # that step's K and V, for `attend`

    def own_input(self, x: torch.Tensor, position_embeddings) -> None:
        self._session_step = x.shape[1] == 1

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
                size = grown_size(have, end, self.capacity)
            dtype = self.store_dtype or key_states.dtype
            k = key_states.new_empty(*key_states.shape[:2], size, key_states.shape[3], dtype=dtype)
            v = value_states.new_empty(*value_states.shape[:2], size, value_states.shape[3], dtype=dtype)
            if have:
                k[:, :, : self.length] = self._k[:, :, : self.length]
                v[:, :, : self.length] = self._v[:, :, : self.length]
            self._k, self._v = k, v
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        past, self.length = self.length, end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        session_step, self._session_step, self._new = self._session_step, False, None
        if self._k.dtype == key_states.dtype:
            return self.keys, self.values
        if session_step and n == 1 and past > 0:  # `attend` widens the past a slice at a time
            self._new = (key_states, value_states)
            return self._k[:, :, :past], self._v[:, :, :past]
        # the past as stored, widened; the new positions as computed (as an offloaded layer attends),
        # each written once into the step's tensors (a widened copy, then a concatenation, would
        # move the past twice)
        return _widened(self._k, key_states, past), _widened(self._v, value_states, past)

    def attend(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        new, self._new = self._new, None
        valid = None if new is None else key_validity(attention_mask, key)
        if valid is None:
            if new is not None:  # a mask this path does not read: the past widened whole, then the new positions
                key, value = _widened(key, new[0], key.shape[2]), _widened(value, new[1], value.shape[2])
            return super().attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        return attend_stored(query, (key, value), valid, new, attention_scaling(query, scaling))[0], None

    @staticmethod
    def planned_bytes(batch: int, kv_heads: int, positions: int, head_dim: int, dtype: torch.dtype) -> int:
        """What it holds for a generation reaching `positions` (the cache reserves them all)."""
        return 2 * batch * kv_heads * positions * head_dim * dtype.itemsize

    def held_bytes(self) -> int:
        """Its preallocated buffers (spare capacity included)."""
        return sum(t.nbytes for t in (self._k, self._v) if t is not None)

    def close(self) -> None:
        self._k = self._v = self.keys = self.values = None


class LocalLayer(SessionLayer):
    """A sliding-window (local) layer: it keeps the last `window` - 1 positions with the compute
    and returns them followed by the new ones, exactly as transformers' `DynamicSlidingWindowLayer`
    does, and reports the same mask sizes, so that the model's own sliding-window mask decides
    what each query sees. Its KV is bounded by the window whatever the context: never offloaded,
    never speculated.

    Kept in `store_dtype` when given (the KV's storage dtype, as `ComputeLayer`: half the bytes
    where the model computes in float32); a step then attends the window as stored, widened, and
    its own new positions as computed."""

    role = Role.LOCAL
    is_sliding = True

    def __init__(self, index: int, window: int, store_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"a local layer needs a window of at least 1 position, got {window}")
        self.index, self.window, self.store_dtype = index, window, store_dtype
        self.length = 0
        self.stats = LayerStats()
        self.peak_bytes = 0  # the most KV bytes it held after an update

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        dtype = self.store_dtype or key_states.dtype
        self.keys = key_states[:, :, :0].to(dtype)
        self.values = value_states[:, :, :0].to(dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        full_k = _widened(self.keys, key_states, self.keys.shape[2])
        full_v = _widened(self.values, value_states, self.values.shape[2])
        self.keys, self.values = self._window(self.keys, full_k), self._window(self.values, full_v)
        self.length += key_states.shape[2]
        self.peak_bytes = max(self.peak_bytes, 2 * self.keys.numel() * self.keys.element_size())
        return full_k, full_v

    def _window(self, kept: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """The last `window` - 1 positions of `full` (what it kept, then the new positions) in the
        kept dtype: a view of the step's tensor when that is the kept dtype (a copy after a prefill,
        never a view of the whole prompt), else the stored copy."""
        last = full[:, :, max(full.shape[2] - (self.window - 1), 0) :]
        if last.dtype != kept.dtype:
            return last.to(kept.dtype)
        return last.clone() if full.shape[2] - kept.shape[2] > 1 else last

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv length, kv offset) of what `update` will return, as the sliding mask needs them."""
        offset = max(self.length - self.window + 1, 0)
        return min(self.length, self.window - 1) + query_length, offset

    def get_max_length(self) -> int:
        return self.window

    @staticmethod
    def planned_bytes(batch: int, kv_heads: int, positions: int, head_dim: int, dtype: torch.dtype, window: int) -> int:
        """The most it holds for a generation reaching `positions`: its window."""
        return 2 * batch * kv_heads * min(positions, window - 1) * head_dim * dtype.itemsize

    def held_bytes(self) -> int:
        """The window it holds now."""
        return sum(t.nbytes for t in (self.keys, self.values) if t is not None)

    def close(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False


# ---------------------------------------------------------------------- offloaded layers
class AttendObserver(Protocol):
    """Something that watches each decode step of a selecting layer — evaluation's recall
    (`infinigen.measure.recall`). The runtime only calls it, and only when one is set: what it
    measures costs the decode path nothing otherwise."""

    def on_attend(
        self,
        layer: int,
        query: torch.Tensor,
        selection: Selection,
        keys: torch.Tensor,
        real: torch.Tensor,
        scaling: float,
    ) -> None:
        """A step attended `selection` (top-ups included) and the current token: query [B, H, 1, d];
        keys [B, Hkv, past, d] every past position's key as stored (called only while the tier
        holds them all); real [B, past] the real tokens; scaling as the attention applied it."""

    def report(self, layer: int) -> dict[str, Any]:
        """What it measured at `layer`, merged into `summary()`'s entry of that layer."""


@dataclass(frozen=True)
class OffloadSettings:
    """What the cache decided for one offloaded layer: fixed for the cache's life.

    role: ``fetch_all`` (every row, every decode step) or ``select`` (the selector's rows);
    pooled: its tier is a capped host pool."""

    index: int
    role: Role
    pooled: bool = False


@dataclass(eq=False)
class Shared:
    """What the offloaded layers of one cache share: where tiers come from, which positions are
    real, the cache's counters, the buffers transfers land in, the prefetch thread (None: select
    and fetch inline) and the observer (None: nothing watches)."""

    storage: Storage
    positions: Positions
    counters: CacheCounters
    buffers: RowBuffers = field(default_factory=RowBuffers)
    prefetch: Executor | None = None
    observer: AttendObserver | None = None
    fetch_chunk: int = 0  # a layer that reads every row reads this many positions at a time (0: all at once)

    def valid(self, tier: KVTier, past: int, device) -> torch.Tensor:
        """[B, Hkv, past]: the positions of `tier` that exist for each KV head (real, still
        stored); `all_valid` when every one does (no padding, no capped pool), which costs nothing."""
        b, hkv = tier.batch, tier.kv_heads
        present = tier.present(past)
        if present is None and not self.positions.padded:
            return all_valid(b, hkv, past, device)
        valid = self.positions.upto(b, past, device)[:, None, :].expand(b, hkv, past)
        return valid if present is None else valid & present.to(valid.device)

    def context(self, batch: int, past: int, device) -> int | torch.Tensor:
        """The real context a fetched fraction is of: `past`, or [B] real tokens when some are padding."""
        if not self.positions.padded:
            return past
        return self.positions.upto(batch, past, device).sum(-1)


@dataclass(frozen=True)
class Step:
    """What a decode step's `update` hands to its `attend`: the function that attends (given the
    step, the query, the key and value `update` returned, and the scaling), the positions before
    the step, the rows read back for it, the selection they hold (None: a range of rows) and the
    step's own K and V as computed, attended beside the rows."""

    attend: Callable[..., torch.Tensor]
    past: int
    rows: Rows | None = None
    selection: Selection | None = None
    new: Rows | None = None


class OffloadedLayer(SessionLayer):
    """A layer whose whole KV lives in a slow tier and whose every row is read back each decode
    step (see the module docstring). A decode step is four verbs: `issue` its transfer (one
    layer ahead), `update` (wait for the rows, append the new KV, hand `attend` a `Step`), and
    `attend`. `SelectingLayer` reads a selection instead, `WindowLayer` a window."""

    selecting: LayerSelector | None = None  # the selector's calls for this layer (`SelectingLayer`)

    def __init__(self, settings: OffloadSettings, shared: Shared) -> None:
        super().__init__()
        self.settings, self.shared = settings, shared
        self.tier: KVTier | None = None
        self.length = 0
        self.record = Recorder(settings.index, shared.counters)
        self._transfer: Transfer | None = None
        self._step: Step | None = None  # None: the model's own attention over what `update` returned

    @property
    def index(self) -> int:
        return self.settings.index

    @property
    def role(self) -> Role:
        return self.settings.role

    @property
    def stats(self) -> LayerStats:
        return self.record.stats

    # ------------------------------------------------------------------ the session's hooks
    def own_input(self, x: torch.Tensor, position_embeddings) -> None:
        """This layer's input arrived: issue what nobody issued ahead (layer 0, or a selector
        that needs this layer's own query)."""
        if self._decoding(x) and self._transfer is None:
            self.issue(x, position_embeddings, issued_at=self.index)

    def previous_input(self, x: torch.Tensor, position_embeddings) -> None:
        """The previous layer's input arrived: issue this layer's transfer now, so that it runs
        while the previous layer computes."""
        if self._decoding(x) and self._transfer is None:
            self.issue(x, position_embeddings, issued_at=self.index - 1)

    def _decoding(self, x: torch.Tensor) -> bool:
        return x.shape[1] == 1 and self.length > 0 and self.tier is not None

    # ------------------------------------------------------------------ issue
    @torch.no_grad()
    def issue(self, x: torch.Tensor, position_embeddings, issued_at: int) -> None:
        """Start this layer's transfer for the coming step: a read of every row (x, the input
        that issued it, is a selector's; this layer needs none)."""
        self._transfer = self._every_row_step(self.length, issued_at)
        self.record.issued(issued_at, self.length, None)

    @property
    def _rows_dtype(self) -> torch.dtype:
        """What a selection's rows, or a chunk of every row, are read back as: the tier's own
        dtype (16 bits for 16-bit KV), widened a slice at a time while attended."""
        return self.tier.rows_dtype(self.dtype)

    def _buffers(self, rows: int, second: bool = False, whole: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's transfer buffers with room for `rows` (see `RowBuffers`): `whole`, for
        every row of the past and the new token in the compute dtype (the model attends them)."""
        dtype = self.dtype if whole else self._rows_dtype
        return self.shared.buffers.pair(self.index, self.tier, rows, dtype, self.device, second, whole)

    def _every_row_step(self, past: int, issued_at: int) -> Transfer:
        """A decode step's read of every row: the whole past at once, or its first chunk when
        the layer reads in chunks (the others are read while it attends)."""
        chunk = self.shared.fetch_chunk
        if chunk <= 0:
            return Transfer.every_row(
                self.tier, past, self.device, self.dtype, self._buffers(past + 1, whole=True), issued_at
            )
        return self._chunk(0, min(chunk, past), issued_at)

    def _chunk(self, start: int, stop: int, issued_at: int, second: bool = False) -> Transfer:
        """The read of positions [start, stop) into the first or second pair of buffers."""
        out = self._buffers(stop - start, second)
        return Transfer.chunk(self.tier, start, stop, self.device, self._rows_dtype, out, issued_at)

    def _prefill_read(self, past: int) -> Transfer:
        """What a prefill chunk after the first attends of the past: every row, in the compute dtype."""
        return Transfer.every_row(self.tier, past, self.device, self.dtype, None, self.index)

    # ------------------------------------------------------------------ transformers' layer API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new KV and return what this step attends: at the prefill, the new KV itself;
        at a decode step that reads every row, those rows followed by the new positions (what
        the model's attention takes); at a step that attends a selection, the selected rows
        alone, as stored (the step's own K and V are kept beside them, as computed, and attended
        with them in `attend`). Rows are waited on here, and only here."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        self._step = None
        past = self.length
        fetched = self._wait(n)
        self._append(key_states, value_states)
        if fetched is None:
            return key_states, value_states  # prefill: dense, from the freshly computed KV
        if n > 1:  # a prefill chunk after the first: the past, read whole into its own tensors
            return torch.cat([fetched.rows[0], key_states], 2), torch.cat([fetched.rows[1], value_states], 2)
        self.stats.count_step(fetched.fraction)
        return self._decode_rows(fetched, past, key_states, value_states)

    def _decode_rows(self, fetched: Fetched, past: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """What a decode step's `update` returns, given its rows, and the step `attend` takes."""
        if self.shared.fetch_chunk > 0:  # the rest is read while attending
            self._step = Step(self._attend_chunks, past, fetched.rows)
            return key_states, value_states
        # every row: the model's own attention over them and the new token
        return self._place(fetched.rows[0].shape[2], key_states, value_states)

    def _place(self, m: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """The new positions, written after the m rows read back (every row of the past, in the
        compute dtype), in the buffers they landed in: what transformers' `update` returns."""
        n = key_states.shape[2]
        k_rows, v_rows = self._buffers(m + n, whole=True)  # the fetched rows are its first m slots already
        k_rows[:, :, m : m + n] = key_states
        v_rows[:, :, m : m + n] = value_states
        return k_rows[:, :, : m + n], v_rows[:, :, : m + n]

    def _wait(self, n: int) -> Fetched | None:
        """This step's rows: the transfer issued for it or, for a prefill chunk after the first
        (or a step nobody issued), a read of every row now. Waited on before the tier is
        written: it is never written while read. A prefill chunk reads the whole past once, into
        tensors dropped after this layer, so the transfer buffers stay sized for a decode step."""
        past, transfer, self._transfer = self.length, self._transfer, None
        if past == 0:
            return None
        if n > 1 or transfer is None:
            if transfer is not None:
                transfer.settle()
            transfer = self._prefill_read(past) if n > 1 else self._every_row_step(past, self.index)
        return self._waited(transfer)

    def _waited(self, transfer: Transfer) -> Fetched:
        fetched = transfer.wait()
        self.record.waited(fetched.waited)
        return fetched

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """The new positions go to the tier (made at the first update); returns which are real."""
        b, hkv, n, d = key_states.shape
        if self.tier is None:
            self.tier = self.shared.storage.new_tier(
                b, hkv, d, key_states.dtype, pooled=self.settings.pooled, positions=n, device=key_states.device
            )
        new_valid = self.shared.positions.upto(b, self.length + n, key_states.device)[:, self.length :]
        self.tier.append(key_states, value_states, new_valid)
        self.length += n
        return new_valid

    # ------------------------------------------------------------------ attend
    def attend(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        step, self._step = self._step, None
        if step is not None:
            return step.attend(step, query, key, value, attention_scaling(query, scaling)), None
        # the prefill, or every row read back: the model's own attention
        return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    def _attend_chunks(self, step: Step, query, key, value, scaling: float) -> torch.Tensor:
        """Every row, read and attended a chunk at a time (`attention.attend_in_chunks`)."""
        present = self.shared.valid(self.tier, step.past, self.device)

        def issue(start: int, stop: int, second: bool):
            transfer = self._chunk(start, stop, self.index, second)
            return lambda: self._waited(transfer).rows

        valid = None if is_all_valid(present) else present
        chunk = self.shared.fetch_chunk
        return attend_in_chunks(query, key, value, scaling, step.rows, step.past, chunk, issue, valid)

    # ------------------------------------------------------------------ release
    def close(self) -> None:
        """Wait for the transfer in flight and release the tier (remove its file)."""
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            try:
                transfer.settle()
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


class SelectingLayer(OffloadedLayer):
    """An offloaded layer whose selector chooses the rows each decode step reads: the choice
    and the gather run on the prefetch thread when the selector can choose from the previous
    layer's input; the selected rows are attended as stored, beside the step's own K and V;
    the selector may top the choice up with the layer's own query, and sees the weights."""

    def __init__(self, settings: OffloadSettings, shared: Shared, selector: Selector) -> None:
        super().__init__(settings, shared)
        self.selecting = LayerSelector(selector, settings.index, shared.storage.reserve)

    def previous_input(self, x: torch.Tensor, position_embeddings) -> None:
        """Issue ahead unless the selector needs this layer's own query (`own_input` then)."""
        if self.selecting.query_from != "own":
            super().previous_input(x, position_embeddings)

    @torch.no_grad()
    def issue(self, x: torch.Tensor, position_embeddings, issued_at: int) -> None:
        """Issued ahead (from the previous layer's input), the selection and the fetch run on
        the cache's prefetch thread while the compute thread goes on with the previous layer;
        issued at the layer itself, they run now."""
        past = self.length
        valid = self.shared.valid(self.tier, past, self.device)
        plan = functools.partial(self._select_and_fetch, x, position_embeddings, past, valid, issued_at)
        self._transfer = Transfer.issue(plan, issued_at, self.shared.prefetch if issued_at < self.index else None)

    def _reads_in_place(self) -> bool:
        """Whether this step attends the selected rows where the tier keeps them (host memory beside
        a CPU compute, the kernels built, nothing that needs the weights), instead of gathering them
        into the transfer buffers first: the same rows, one copy fewer."""
        storage = self.shared.storage
        return self.tier.in_place() is not None and reads_in_place(
            storage.tier, storage.fmt, self.settings.pooled, self.selecting.observes, self.tier.head_dim,
            self.device.type,
        )  # fmt: skip

    @torch.no_grad()
    def _select_and_fetch(self, x: torch.Tensor, position_embeddings, past: int, valid: torch.Tensor, issued_at: int):
        """Ask the selector, then start the gather of its rows into this layer's buffers (or, read
        in place, count them: the attention reads them)."""
        start = time.perf_counter()
        selection = self.selecting.select(self.selecting.last_query(x, position_embeddings, self.device), past, valid)
        self.record.speculated(time.perf_counter() - start)
        self.record.issued(issued_at, past, selection)
        context = self.shared.context(self.tier.batch, past, self.device)
        if self._reads_in_place():
            self.tier.count_in_place(int(selection.valid.sum()))
            return Planned(done_future(lambda: IN_PLACE), selection, float(fetched_fraction(selection, context)))
        out = self._buffers(selection.indices.shape[2])
        rows = self.tier.gather_async(selection.indices, selection.valid, self.device, self._rows_dtype, out=out)
        # The compute thread waits on `rows` (a device transfer orders that thread's stream).
        return Planned(rows, selection, float(fetched_fraction(selection, context)))

    def _decode_rows(self, fetched: Fetched, past: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """The selected rows alone, as stored; the step's own K and V go to `attend` beside them.
        A step nobody issued (the cache driven without a session's hooks) read every row."""
        if fetched.selection is None:
            return super()._decode_rows(fetched, past, key_states, value_states)
        if fetched.rows is IN_PLACE:
            self._step = Step(self._attend_in_place, past, None, fetched.selection, (key_states, value_states))
            return key_states, value_states
        self._step = Step(self._attend_selection, past, fetched.rows, fetched.selection, (key_states, value_states))
        return fetched.rows

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """The new positions go to the tier and their keys to the selector."""
        new_valid = super()._append(key_states, value_states)
        self.selecting.append(key_states, new_valid)
        return new_valid

    def attend(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if self._step is None and query.shape[2] > 1:  # a prefill: the selector may want its weights
            valid = self.shared.positions.upto(query.shape[0], key.shape[2], query.device)
            self.selecting.prefill(PrefillAttention(query, key, valid, attention_scaling(query, scaling)))
        return super().attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    def _attend_selection(self, step: Step, query, key, value, scaling: float) -> torch.Tensor:
        """Softmax over the selected rows (and any top-up) and the current token; the selector
        sees the weights if it looks at them (H2O accumulates them)."""
        key, value, selection = self._top_up(query, key, value, step.selection)
        observes = self.selecting.observes
        out, probs = attend_stored(query, (key, value), selection.valid, step.new, scaling, weights=observes)
        if observes:
            p = probs[:, :, -1]
            self.selecting.observe(selection, p[..., :-1], p[..., -1])
        self._notify(query, selection, scaling)
        return out

    def _attend_in_place(self, step: Step, query, key, value, scaling: float) -> torch.Tensor:
        """The selected rows (and any top-up) attended where the tier keeps them, with the current
        token (`kernels.attend_rows`, on the compute's threads)."""
        selection, past = step.selection, step.past
        start = time.perf_counter()
        extra = self.selecting.top_up(query[:, :, -1], past, self.shared.valid(self.tier, past, self.device), selection)
        if extra is not None:
            rows = int(extra.valid.sum())
            self.tier.count_in_place(rows)
            context = self.shared.context(self.tier.batch, past, self.device)
            fraction = float(fetched_fraction(extra, context))
            self.record.topped_up(rows, fraction, rows * self.tier.row_bytes, time.perf_counter() - start)
            selection = with_top_up(selection, extra)
        b, h, _, d = query.shape
        hkv = self.tier.kv_heads
        order = torch.argsort((~selection.valid).to(torch.uint8), dim=-1, stable=True)  # the chosen slots first
        positions = selection.indices.gather(-1, order)
        counts = selection.valid.sum(-1)
        q = query.reshape(b, hkv, h // hkv, d).to(torch.float32) * scaling
        new_k, new_v = step.new
        out = kernels.attend_rows(
            kernels.KVRows.contiguous(*self.tier.in_place()), q, torch.full((b,), past), positions, counts,
            (new_k[:, :, 0], new_v[:, :, 0]),
        )  # fmt: skip
        self._notify(query, selection, scaling)
        return out.to(query.dtype).reshape(b, 1, h, d)

    def _top_up(self, query, key, value, selection: Selection):
        """Speculate, then correct: the selector may add positions chosen with this layer's own
        query; they are fetched now (a second transfer, not overlapped: its time is the
        correction's), placed after the first transfer's rows, and attended with them."""
        past = self.length - 1
        start = time.perf_counter()
        extra = self.selecting.top_up(query[:, :, -1], past, self.shared.valid(self.tier, past, self.device), selection)
        if extra is None:
            return key, value, selection
        k_x, v_x = self.tier.gather_async(extra.indices, extra.valid, self.device, key.dtype).result()
        rows = int(extra.valid.sum())
        context = self.shared.context(self.tier.batch, past, self.device)
        fraction = float(fetched_fraction(extra, context))  # the step fetched these too
        self.record.topped_up(rows, fraction, rows * self.tier.row_bytes, time.perf_counter() - start)
        return torch.cat([key, k_x], 2), torch.cat([value, v_x], 2), with_top_up(selection, extra)

    def _notify(self, query: torch.Tensor, selection: Selection, scaling: float) -> None:
        """Show the step to the observer, if one is set and the tier still holds every key."""
        observer = self.shared.observer
        if observer is None or self.tier.present(self.length) is not None:
            return
        past = self.length - 1
        keys = self.tier.peek_all()[0][:, :, :past]
        real = self.shared.positions.upto(query.shape[0], past, query.device)
        observer.on_attend(self.index, query, selection, keys, real, scaling)


class WindowLayer(OffloadedLayer):
    """A sliding-window layer whose KV lives in the slow tier (`windows_on_compute=False`): each
    decode step reads back the last `window` - 1 positions, a range read issued one layer ahead
    like every offloaded layer's, and attends them (`attention.attend_stored`, as stored, with
    the padding and the new token as computed) — what `LocalLayer` attends, without keeping it.
    A prefill chunk after the first reads the same window and the model's sliding mask applies,
    with `LocalLayer`'s mask sizes. The tier holds every position (it only appends); the compute
    keeps a window's rows in the transfer buffers instead of every sliding layer's window."""

    is_sliding = True

    def __init__(self, settings: OffloadSettings, shared: Shared, window: int) -> None:
        super().__init__(settings, shared)
        if window < 1:
            raise ValueError(f"a sliding layer needs a window of at least 1 position, got {window}")
        self.window = window

    get_mask_sizes = LocalLayer.get_mask_sizes

    def get_max_length(self) -> int:
        return self.window

    def _start(self, past: int) -> int:
        """The first position of the window a step with `past` positions before it attends."""
        return max(past - (self.window - 1), 0)

    def _every_row_step(self, past: int, issued_at: int) -> Transfer:
        start = self._start(past)
        out = self._buffers(past - start)
        return Transfer.chunk(
            self.tier, start, past, self.device, self._rows_dtype, out, issued_at, (past - start) / max(past, 1)
        )

    def _prefill_read(self, past: int) -> Transfer:
        return Transfer.chunk(self.tier, self._start(past), past, self.device, self.dtype, None, self.index)

    def _decode_rows(self, fetched: Fetched, past: int, key_states: torch.Tensor, value_states: torch.Tensor):
        self._step = Step(self._attend_window, past, fetched.rows, new=(key_states, value_states))
        return key_states, value_states

    def _attend_window(self, step: Step, query, key, value, scaling: float) -> torch.Tensor:
        valid = self.shared.valid(self.tier, step.past, self.device)[:, :, self._start(step.past) : step.past]
        return attend_stored(query, step.rows, valid, step.new, scaling)[0]
