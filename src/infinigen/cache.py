"""InfiniGenCache: a thin transformers `Cache` holding one object per layer (see `layers.py`).

The cache decides nothing per step: its layers do. It builds them from the config (one role per
layer: with the compute, offloaded and read whole, offloaded and selected, or local — a
sliding-window layer, whose window-sized KV stays with the compute), checks that the
context fits the model, counts prefill and decode steps, and sums what its layers measured.
Get one from an attach session (``session.new_cache()``): the session's hooks drive its layers.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from infinigen.budget import MemoryBudgetError, Plan, TransferRows, transfer_rows
from infinigen.config import InfiniGenConfig
from infinigen.errors import InfiniGenError
from infinigen.layers import (
    AttendObserver,
    ComputeLayer,
    LocalLayer,
    OffloadedLayer,
    OffloadSettings,
    Positions,
    SelectingLayer,
    Shared,
    WindowLayer,
)
from infinigen.memory import MemoryReport, memory_report
from infinigen.roles import Role
from infinigen.select import Selector
from infinigen.storage import Storage
from infinigen.summary import summarize
from infinigen.transfer import CacheCounters, RowBuffers

HOW_TO_MAKE = (
    "an InfiniGenCache is made by an attach session: "
    "`with infinigen.attach(model, config) as session: cache = session.new_cache()` "
    "(or call plain `model.generate(...)` inside the `with` block)"
)


class ContextTooLongError(InfiniGenError, ValueError):
    """The prompt (plus what will be generated) does not fit the model's context."""


class CacheInputError(InfiniGenError, ValueError):
    """KV handed to `update` that does not fit the cache: layer, shape, dtype or device."""


class CacheClosedError(InfiniGenError, RuntimeError):
    """A closed InfiniGenCache used again: its tiers, files and threads are gone."""


class SessionCache(Cache):
    """A cache whose layers answer an attach session's hooks (`own_input`, `previous_input`,
    `attend`); the session describes each forward's tokens with `begin_forward`."""

    positions: Positions

    def begin_forward(self, valid: torch.Tensor) -> None:
        """valid [B, q]: which of this forward's q new tokens are real (False at left padding)."""
        self.positions.describe(self.get_seq_length(), valid)


class InfiniGenCache(SessionCache):
    """KV cache whose offloaded layers keep their full KV in a slow tier and read back, per
    decode step, every row or the rows their selector chooses (see `layers.py`).

    max_length: the positions this generation will reach (prompt + new tokens), if known: it
                sizes disk files, compute-side buffers and a capped host pool; default: the
                model's context. trace: keep a `TransferRecord` of every transfer issued.
    observer:   what watches each decode step's attention (`AttendObserver`; evaluation's
                recall, `infinigen.measure.recall`), or None; settable until the first decode step.
    One cache serves one generation and its continuations (``past_key_values=`` again, a new
    turn included); `close()` (or a ``with`` block, or the session's detach, or garbage
    collection) removes its files, and a closed cache refuses to be used again.
    """

    def __init__(
        self,
        config: InfiniGenConfig,
        adapter,
        selector: Selector | None = None,
        *,
        max_length: int | None = None,
        trace: bool = False,
        observer: AttendObserver | None = None,
        plan: Plan | None = None,
    ) -> None:
        if isinstance(config, nn.Module) or not isinstance(config, InfiniGenConfig):
            raise TypeError(HOW_TO_MAKE)
        if config.spec.selector is not None and selector is None:
            raise ValueError(f"policy {config.policy!r} needs its selector; {HOW_TO_MAKE}")
        self.config = config
        self.adapter = adapter
        self.selector = selector
        self.plan = plan  # what was planned to stay with the compute (budget.plan), if planned
        limit = adapter.max_positions
        if max_length is not None and not 0 < max_length <= limit:
            raise ContextTooLongError(f"max_length {max_length} must be in [1, {limit}] (the model's context)")
        capacity = max_length or limit
        roles = config.layer_roles(adapter)
        self.storage = Storage(
            config.tier,
            config.spec.fmt,
            config.storage_dtype(),
            capacity=capacity,
            reserve=max_length,
            layers=sum(role.offloaded for role in roles),
            directory=config.kv_dir,
            io_threads=config.io_threads,
            device=next(adapter.model.parameters()).device,
            host_capacity=config.host_capacity,
            pool_positions=max_length,
            eviction=config.eviction,
            block_cache=config.block_cache,
            copy_engine=config.copy_engine,
            read_chunk=config.read_chunk_bytes,
        )
        self.positions = Positions()
        self._batch: int | None = None  # the batch of the first update: every update must match it
        self.counters = CacheCounters(trace=[] if trace else None)
        # Selection and fetch of a layer run here while the compute thread finishes the layer before.
        self.prefetch = ThreadPoolExecutor(1, thread_name_prefix="infinigen-prefetch") if selector else None
        rows = transfer_rows(config, adapter, selector, max_length) if max_length is not None else TransferRows()
        self._shared = Shared(
            self.storage,
            self.positions,
            self.counters,
            RowBuffers(rows.stored, min(config.fetch_chunk, max_length or config.fetch_chunk), rows.whole),
            prefetch=self.prefetch,
            observer=observer,
            fetch_chunk=config.fetch_chunk,
        )
        layers = _new_layers(config, adapter, selector, self._shared, capacity, reserve=max_length is not None)
        super().__init__(layers=layers)
        self.closed_because: str | None = None  # why it was closed; None while open
        self._memory_at_close: MemoryReport | None = None
        # Collected without close() (an output dropped, a session never detached): its files go too.
        self._finalizer = weakref.finalize(self, _release, layers, self.prefetch, self.storage)

    # ------------------------------------------------------------------ Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.check_open()
        self._check_update(key_states, value_states, layer_idx)
        layer = self.layers[layer_idx]
        past, n = layer.get_seq_length(), key_states.shape[2]
        self._check_length(past, n)
        if layer_idx == 0:
            if past == 0:
                self.counters.batch = key_states.shape[0]
            if past == 0 or n > 1:  # the prompt, its chunks and a continuation's new turn
                self.counters.prefill_tokens += n
            else:
                self.counters.decode_steps += 1
        return layer.update(key_states, value_states)

    def prefill_attention(self, layer_idx: int, weights) -> None:
        """Hand layer `layer_idx`'s selector the attention of a prefill this cache did not run
        (a replayed prefix, `infinigen.prefill.Prefix`), as its own prefill would have: after
        the layer's `update` with the prompt's KV, before any decode step. A layer that does
        not select ignores it."""
        self.check_open()
        selecting = getattr(self.layers[layer_idx], "selecting", None)
        if selecting is not None:
            selecting.prefill(weights)

    def _check_update(self, keys, values, layer_idx) -> None:
        """Refuse, in one sentence, KV that would fail deep inside a layer or be stored wrongly:
        the model's layer count, KV heads and head size, one batch, one dtype and device per layer."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise CacheInputError(f"layer_idx must be an integer in [0, {len(self.layers)}), got {layer_idx!r}")
        for name, t in (("key_states", keys), ("value_states", values)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise CacheInputError(f"{name} must be a floating-point tensor, got {what}")
        want = f"[batch, {self.adapter.num_kv_heads}, new positions >= 1, {self.adapter.head_dim}]"
        shape = tuple(keys.shape)
        if keys.dim() != 4 or shape[1] != self.adapter.num_kv_heads or shape[3] != self.adapter.head_dim:
            raise CacheInputError(f"key_states must be {want} for this model, got {shape}")
        if shape[0] < 1 or shape[2] < 1:
            raise CacheInputError(f"key_states must be {want}, got {shape}: nothing to store")
        if tuple(values.shape) != shape or values.dtype != keys.dtype or values.device != keys.device:
            raise CacheInputError(
                f"value_states must match key_states {shape} {keys.dtype} on {keys.device}, got "
                f"{tuple(values.shape)} {values.dtype} on {values.device}"
            )
        if self._batch is not None and shape[0] != self._batch:
            raise CacheInputError(f"this cache holds a batch of {self._batch}, got key_states {shape}")
        budget = self.plan.budget if self.plan is not None else None
        if self._batch is None and budget is not None and not self.config.aims and shape[0] > self.plan.request.batch:
            raise MemoryBudgetError(
                f"this cache was planned for a batch of {self.plan.request.batch} within compute_memory "
                f"{self.config.compute_memory}, got {shape[0]} rows: make the cache with "
                f"session.new_cache(batch={shape[0]}, max_length=...) so that the plan checks them"
            )
        layer = self.layers[layer_idx]
        if layer.is_initialized and (keys.dtype != layer.dtype or keys.device != layer.device):
            raise CacheInputError(
                f"layer {layer_idx} holds {layer.dtype} KV on {layer.device}, got {keys.dtype} on {keys.device}"
            )
        self._batch = shape[0]

    def _check_length(self, past: int, n: int) -> None:
        limit = self.adapter.max_positions
        if past + n > limit:
            raise ContextTooLongError(
                f"{past + n} tokens exceed the model's context of {limit} positions"
                + (" (the prompt alone is too long)" if past == 0 else "")
            )

    @property
    def observer(self) -> AttendObserver | None:
        """What watches each decode step's attention (None: nothing; see `AttendObserver`)."""
        return self._shared.observer

    @observer.setter
    def observer(self, observer: AttendObserver | None) -> None:
        self._shared.observer = observer

    @property
    def trace(self):
        """Every transfer issued (a list of `TransferRecord`), when made with trace=True."""
        return self.counters.trace

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self.check_open()  # the first thing a forward or `generate` asks a cache
        return self.layers[layer_idx].get_seq_length()

    def reset(self) -> None:
        raise NotImplementedError("an InfiniGenCache serves one generation; make a new one with session.new_cache()")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("InfiniGenCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("InfiniGenCache does not support num_return_sequences > 1")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("InfiniGenCache does not support cropping (assisted decoding)")

    @property
    def closed(self) -> bool:
        return self.closed_because is not None

    def close(self, reason: str = "close() was called") -> None:
        """Release the tiers (remove disk files) and their threads (idempotent); `reason` ends the
        sentence a later use raises. The counters stay: `summary()` works on a closed cache."""
        if self.closed_because is None:
            self._memory_at_close = self.memory()
            self.closed_because = reason
        self._finalizer()

    def check_open(self) -> None:
        """Refuse, in one sentence, to run on a closed cache (its KV is gone)."""
        if self.closed_because is not None:
            raise CacheClosedError(
                f"this InfiniGen cache is closed (its files were released when {self.closed_because}): "
                "start a new generation without past_key_values, or keep the cache open by calling "
                "generate with return_dict_in_generate=True and continuing inside the same attach block"
            )

    def __enter__(self) -> InfiniGenCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close("its `with` block ended")

    # ------------------------------------------------------------------ reporting
    def memory(self) -> MemoryReport:
        """What this cache keeps with the compute now, by part, against dense's KV for the same
        batch and positions (`infinigen.memory`); once closed, what it kept when it closed."""
        if self.closed_because is not None and self._memory_at_close is not None:
            return self._memory_at_close
        return memory_report(self)

    def shared_buffers_bytes(self) -> int:
        """Bytes of the transfer buffers its offloaded layers share."""
        return self._shared.buffers.nbytes

    def summary(self) -> dict[str, Any]:
        """What this generation moved and selected (decode steps only; `infinigen.summary`)."""
        return summarize(self)


def _new_layers(config: InfiniGenConfig, adapter, selector, shared: Shared, capacity: int, reserve: bool) -> list:
    """One object per layer, by the layer's role: its KV with the compute (the whole of it, or a
    sliding window), or in the slow tier (every row read back, a selection, or a window)."""
    layers: list[Any] = []
    for i, role in enumerate(config.layer_roles(adapter)):
        if role == Role.COMPUTE:
            layers.append(ComputeLayer(i, capacity, reserve=reserve, store_dtype=config.storage_dtype()))
        elif role == Role.LOCAL:
            layers.append(LocalLayer(i, adapter.window(i), store_dtype=config.storage_dtype()))
        elif role == Role.WINDOW:
            layers.append(WindowLayer(OffloadSettings(i, role), shared, adapter.window(i)))
        elif role == Role.SELECT:
            pooled = config.host_capacity is not None
            layers.append(SelectingLayer(OffloadSettings(i, role, pooled), shared, selector))
        else:
            layers.append(OffloadedLayer(OffloadSettings(i, role), shared))
    return layers


def _release(layers: list, prefetch: Executor | None, storage: Storage) -> None:
    """Close the layers (their tiers and files), then the threads they used. Holds no reference
    to the cache, so that it can run when the cache is collected."""
    for layer in layers:
        layer.close()
    if prefetch is not None:
        prefetch.shutdown(wait=True)
    storage.close()
