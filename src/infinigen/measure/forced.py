"""Forced runs: S teacher-forced tokens through any policy in one forward pass.

Stepping a model through S decode steps costs S full forward passes. Under teacher forcing the
tokens are known, so the S steps can run as one chunk after a shared dense prefill — provided
every position attends exactly what the step-by-step decode would have let it attend. The chunk
runs through a `ForcedCache` driven by the same attach session, hooks and selectors as decoding:
per layer, each `ForcedLayer` replays its selector's calls in step order (`select` for position s
from the state after s - 1 steps, `on_append` of s's key, `observe` of s's weights), builds the
mask row by row, and attends with the stored KV as the tier would return it (rounded to the
storage dtype, or int4-quantized; the current token's own K and V are exact, as in decode).
The layer roles, storage rounding and row bytes come from the config and storage, exactly as the
cache uses them; a local (sliding-window) layer attends the prefix's window and the chunk as
`LocalLayer` returns them. `tests/test_forced.py` checks logits, fractions, bytes and recall against the
step-by-step decode path.

The prefill is dense for every policy (InfiniGen's prefill is), so one prefill per text serves
every policy; a policy never changes it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from infinigen.attention import attention_scaling, dense_attention
from infinigen.cache import SessionCache
from infinigen.compat import cache_kwargs
from infinigen.config import InfiniGenConfig
from infinigen.layer_selector import LayerSelector, with_top_up
from infinigen.layers import LocalLayer, Positions, SessionLayer
from infinigen.measure.recall import HeadRecall
from infinigen.prefill import chunked_prefill
from infinigen.roles import Role
from infinigen.select import Selector
from infinigen.speculate import Selection, attention_column_sums, selection_mask
from infinigen.storage import roundtrip, row_bytes
from infinigen.transfer import LayerStats, fetched_fraction


@dataclass
class ForcedResult:
    logits: torch.Tensor  # [B, S, V]: after each forced token
    per_layer_fraction: dict[int, float]
    per_layer_recall: dict[int, float]
    per_head_recall: dict[int, list[float]]  # per layer, per query head
    bytes_fetched: int
    rows_fetched: int
    steps: int
    policy: str
    correction_rows: int = 0  # of rows_fetched: the top-ups of speculate-then-correct
    per_layer_correction: dict[int, float] = field(default_factory=dict)  # of per_layer_fraction: the top-ups'

    @property
    def fetched_fraction(self) -> float | None:
        if not self.per_layer_fraction:
            return None
        return sum(self.per_layer_fraction.values()) / len(self.per_layer_fraction)

    @property
    def recall(self) -> float | None:
        if not self.per_layer_recall:
            return None
        return sum(self.per_layer_recall.values()) / len(self.per_layer_recall)

    def bytes_per_token(self, batch: int = 1) -> float:
        return self.bytes_fetched / max(self.steps * batch, 1)


@dataclass
class Prefix:
    """A dense prefill shared by every policy evaluated on the same text."""

    ids: torch.Tensor  # [B, T0]
    cache: DynamicCache
    last_logits: torch.Tensor  # [B, V]: predicts the first forced token (dense for every policy)
    _column_sums: dict[int, torch.Tensor] | None = None

    @property
    def length(self) -> int:
        return self.ids.shape[1]


@dataclass
class _Record:
    """What the layers of one forced run measure together."""

    measure_recall: bool
    fraction: dict[int, float] = field(default_factory=dict)
    recall: dict[int, float] = field(default_factory=dict)
    recall_heads: dict[int, list[float]] = field(default_factory=dict)
    bytes: int = 0
    rows: int = 0
    correction_rows: int = 0
    correction: dict[int, float] = field(default_factory=dict)  # per layer: mean top-up fraction


class _StoredWeights:
    """A prefix's prefill attention for one layer, computed (for every layer) only if asked for."""

    def __init__(self, evaluator: ForcedRunner, prefix: Prefix, layer: int) -> None:
        self._evaluator, self._prefix, self._layer = evaluator, prefix, layer

    def column_sums(self) -> torch.Tensor:
        return self._evaluator.column_sums(self._prefix)[self._layer]


class _PrefillLayer(SessionLayer):
    """A dense prefill layer that can also record its attention's column sums (`bar`: a
    progress bar it advances when it has)."""

    def __init__(self, record: dict[int, torch.Tensor] | None, index: int, bar=None) -> None:
        super().__init__()
        self.record, self.index, self.length, self.bar = record, index, 0, bar

    def update(self, key_states, value_states, *args, **kwargs):
        self.length += key_states.shape[2]
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if self.record is not None:
            valid = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
            self.record[self.index] = attention_column_sums(query, key, valid, attention_scaling(query, scaling))
            if self.bar is not None:
                self.bar.update(1)
        return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@torch.no_grad()
def column_sums_through(session, ids: torch.Tensor, progress: bool = False) -> dict[int, torch.Tensor]:
    """Per global layer, the column sums [B, Hkv, T] of a dense prefill's attention over `ids`
    [B, T] (what H2O accumulates from a prefill), by one forward of the model through the
    attached `session`. Sliding-window layers never select, so they record nothing."""
    adapter = session.adapter
    record: dict[int, torch.Tensor] = {}
    wanted = set(adapter.global_layers)
    with tqdm(
        total=len(wanted), desc="prompt attention (h2o)", unit="layer", file=sys.stderr, leave=False,
        disable=not progress,
    ) as bar:  # fmt: skip
        layers = [_PrefillLayer(record if i in wanted else None, i, bar) for i in range(adapter.num_layers)]
        cache = ForcedCache(layers)
        session.model(input_ids=ids, **cache_kwargs(session.model, cache), use_cache=True, logits_to_keep=1)
    return record


class ForcedLayer(SessionLayer):
    """One layer of a forced run: the prefix's KV, then the S forced positions, attended as the
    step-by-step decode would (see the module docstring). A selecting layer replays its selector
    through the same `LayerSelector` calls as the decode path's `OffloadedLayer`."""

    def __init__(
        self,
        index: int,
        role: Role,
        prefix: Prefix,
        config: InfiniGenConfig,
        selecting: LayerSelector | None,
        record: _Record,
    ) -> None:
        super().__init__()
        self.index, self.role, self.config, self.record = index, role, config, record
        self.selecting = selecting
        self.prefix_keys = prefix.cache.layers[index].keys
        self.prefix_values = prefix.cache.layers[index].values
        self.length = prefix.length
        self.window: int | None = None  # a sliding layer's window (`ForcedLocalLayer`)
        self.inputs: dict[str, tuple[torch.Tensor, Any]] = {}

    def own_input(self, x, pe) -> None:
        self.inputs["own"] = (x, pe)

    def previous_input(self, x, pe) -> None:
        self.inputs["previous"] = (x, pe)

    def update(self, key_states, value_states, *args, **kwargs):
        self.length += key_states.shape[2]
        return torch.cat([self.prefix_keys, key_states], -2), torch.cat([self.prefix_values, value_states], -2)

    def attend(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        stored = self.config.storage_dtype()
        if self.role in (Role.COMPUTE, Role.LOCAL, Role.WINDOW) and (stored is None or stored == key.dtype):
            return dense_attention(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        return self._fetched_attention(query, key, value, attention_scaling(query, scaling))

    def _fetched_attention(self, query, key, value, scaling: float):
        """Attention of S forced positions over the KV a tier would return (or a layer kept with the
        compute holds: in the storage dtype, whatever the tier's format), masked per position."""
        fmt = self.config.spec.fmt if self.role.offloaded else "native"
        b, h, s_len, d = query.shape
        hkv, k_len = key.shape[1], key.shape[2]
        g = h // hkv
        t0 = k_len - s_len
        kv_dtype = self.config.storage_dtype() or key.dtype
        k_st = roundtrip(fmt, key, kv_dtype).to(torch.float32)
        v_st = roundtrip(fmt, value, kv_dtype).to(torch.float32)
        qf = query.to(torch.float32)
        kr, vr = k_st.repeat_interleave(g, 1), v_st.repeat_interleave(g, 1)
        scores = torch.matmul(qf, kr.transpose(-1, -2)) * scaling  # [B, H, S, K]
        rows = torch.arange(s_len, device=query.device)
        self_col = t0 + rows
        k_self = key[:, :, t0:].to(torch.float32).repeat_interleave(g, 1)  # exact: never stored yet
        v_self = value[:, :, t0:].to(torch.float32).repeat_interleave(g, 1)
        scores[:, :, rows, self_col] = (qf * k_self).sum(-1) * scaling
        cols = torch.arange(k_len, device=query.device)
        causal = cols[None, :] <= self_col[:, None]  # [S, K]
        if self.window is not None:  # a sliding layer: the last `window` positions, itself included
            causal &= cols[None, :] > self_col[:, None] - self.window
        if self.role in (Role.COMPUTE, Role.LOCAL, Role.WINDOW):  # a window read back is exact; counted in `attend`
            allowed = causal[None, None].expand(b, h, s_len, k_len)
        elif self.role == Role.FETCH_ALL:
            allowed = causal[None, None].expand(b, h, s_len, k_len)
            n_rows = b * hkv * int((t0 + rows).sum())
            self.record.rows += n_rows
            self.record.bytes += n_rows * row_bytes(fmt, d, kv_dtype)
        else:
            mask = self._replay_selection(scores, query, key, t0, s_len, row_bytes(fmt, d, kv_dtype))
            allowed = mask[:, :, None].expand(b, hkv, g, s_len, k_len).reshape(b, h, s_len, k_len)
            allowed = allowed | (cols[None, :] == self_col[:, None])[None, None]
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1)
        out = torch.matmul(probs, vr)
        p_self = probs[:, :, rows, self_col]  # [B, H, S]
        out = out + p_self[..., None] * (v_self - vr[:, :, t0:])  # the current token's exact V
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    def _replay_selection(self, scores, own_query, key, t0: int, s_len: int, per_row: int) -> torch.Tensor:
        """The selector's step-by-step selections of this layer for the S positions, with the
        top-ups its own queries add, in the decode path's order (select, append, top up,
        observe) and counted by its rules: [B, Hkv, S, K]."""
        selecting, record, i = self.selecting, self.record, self.index
        b, hkv, k_len = key.shape[0], key.shape[1], key.shape[2]
        queries = None
        if selecting.query_from is not None:
            queries = selecting.query(*self.inputs[selecting.query_from])  # [B, H, S, d]
        real = torch.ones(b, 1, k_len, dtype=torch.bool, device=key.device)
        new_valid = torch.ones(b, 1, dtype=torch.bool, device=key.device)
        mask = torch.zeros(b, hkv, s_len, k_len, dtype=torch.bool, device=key.device)
        stats, recall, topped_up = LayerStats(), HeadRecall() if record.measure_recall else None, 0.0
        for s in range(s_len):
            past = t0 + s
            valid = real[..., :past].expand(b, hkv, past)
            sel = selecting.select(queries[:, :, s] if queries is not None else None, past, valid)
            selecting.append(key[:, :, past : past + 1], new_valid)
            stats.count_step(float(fetched_fraction(sel, past)))
            extra = selecting.top_up(own_query[:, :, s], past, valid, sel)
            if extra is not None:
                fraction = float(fetched_fraction(extra, past))
                stats.count_top_up(int(extra.valid.sum()), fraction)
                topped_up += fraction
                sel = with_top_up(sel, extra)
            mask[:, :, s, :past] = selection_mask(sel, past)
            self._observe(scores[:, :, s, : past + 1], mask[:, :, s, :past], sel)
            n = int(sel.valid.sum())
            record.rows += n
            record.bytes += n * per_row
            if recall is not None:
                recall.add(torch.softmax(scores[:, :, s, :past], -1), sel)
        record.fraction[i] = stats.fraction()
        record.correction_rows += stats.correction_rows
        if topped_up:
            record.correction[i] = topped_up / s_len
        if recall is not None:
            heads = recall.per_head()
            record.recall[i] = heads.mean().item()
            record.recall_heads[i] = heads.tolist()
        return mask

    def _observe(self, scores: torch.Tensor, selected: torch.Tensor, sel: Selection) -> None:
        """The step's weights, as the decode path's attention gives them to the selector: the
        softmax of scores [B, H, past + 1] over the selected positions [B, Hkv, past] and itself."""
        if not self.selecting.observes:
            return
        g = scores.shape[1] // selected.shape[1]
        past = selected.shape[-1]
        allowed = torch.cat([selected, selected.new_ones(*selected.shape[:2], 1)], -1)
        p = torch.softmax(scores.masked_fill(~allowed.repeat_interleave(g, 1), -math.inf), -1)
        self.selecting.observe(sel, p.gather(-1, sel.indices.repeat_interleave(g, 1)), p[..., past])


class ForcedLocalLayer(ForcedLayer):
    """A sliding-window layer of a forced run: the prefix's last `window` - 1 positions, then the
    S forced positions, each seeing its last `window` positions as `LocalLayer` returns them (the
    model's own sliding mask when the KV is kept as computed; stored in the storage dtype, the
    past rounded and the current position exact, as decoding attends it)."""

    is_sliding = True

    def __init__(
        self, index: int, prefix: Prefix, config: InfiniGenConfig, record: _Record, window: int, role: Role
    ) -> None:
        """role: ``local`` (the window kept with the compute) or ``window`` (read back from the
        tier each step: the same rows, counted as read)."""
        super().__init__(index, role, prefix, config, None, record)
        self.window, self.prefix_length = window, prefix.length
        keep = min(prefix.length, window - 1)
        start = self.prefix_keys.shape[2] - keep
        self.prefix_keys, self.prefix_values = self.prefix_keys[:, :, start:], self.prefix_values[:, :, start:]

    get_mask_sizes = LocalLayer.get_mask_sizes

    def attend(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if self.role == Role.WINDOW:  # the rows `WindowLayer` reads: each step its last window - 1 positions
            b, hkv, d = query.shape[0], key.shape[1], key.shape[-1]
            steps = range(query.shape[2])
            n_rows = b * hkv * sum(min(self.window - 1, self.prefix_length + s) for s in steps)
            self.record.rows += n_rows
            self.record.bytes += n_rows * row_bytes("native", d, self.config.storage_dtype() or key.dtype)
        return super().attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    def get_max_length(self) -> int:
        return self.window


class ForcedCache(SessionCache):
    """The layers of one forced run, for the session's hooks."""

    def __init__(self, layers: list[CacheLayerMixin]) -> None:
        super().__init__(layers=layers)
        self.positions = Positions()


class ForcedRunner:
    """Teacher-forced runs of many configs on one text through an attached session of the model,
    sharing one dense prefill. The session is someone else's (`Evaluator` owns one; the budget
    spread's choice, `infinigen.measure.spread_choice`, runs inside the session that asks for it)."""

    def __init__(self, model: nn.Module, session=None) -> None:
        self.model = model
        self._session = session

    @property
    def session(self):
        if self._session is None or not self._session.attached:
            raise RuntimeError("the session these forced runs go through is detached")
        return self._session

    @property
    def adapter(self):
        return self.session.adapter

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> Prefix:
        """Dense prefill of ids [B, T0] (in chunks, see `infinigen.prefill`)."""
        if ids.dim() == 1:
            ids = ids[None]
        _ = self.session  # attached before the forward, so that every run sees the same model
        cache = DynamicCache(config=self.model.config)
        out = chunked_prefill(self.model, ids, cache, logits_to_keep=1)
        return Prefix(ids, cache, out.logits[:, -1].float())

    @torch.no_grad()
    def column_sums(self, prefix: Prefix) -> dict[int, torch.Tensor]:
        """Per layer, the prefill's attention column sums (what H2O accumulates), computed once
        per prefix by a second prefill pass the first time a selector asks."""
        if prefix._column_sums is None:
            prefix._column_sums = column_sums_through(self.session, prefix.ids)
        return prefix._column_sums

    @torch.no_grad()
    def run(
        self, prefix: Prefix, chunk: torch.Tensor, config: InfiniGenConfig, measure_recall: bool = False
    ) -> ForcedResult:
        """Logits after each token of `chunk` [B, S] when decoding under `config`'s policy."""
        if chunk.dim() == 1:
            chunk = chunk[None]
        session = self.session
        adapter = session.adapter
        # `config` as given: the memory plan a cache would make (`compute_memory`) is not applied.
        # The default aim's changes are lossless (the same logits); bytes are the config's own.
        selector = session.selector_for(config)
        record = _Record(measure_recall=measure_recall and selector is not None)
        layers = []
        for i, role in enumerate(config.layer_roles(adapter)):
            if role.sliding:  # its window of the prefix, then the chunk
                layers.append(ForcedLocalLayer(i, prefix, config, record, adapter.window(i), role))
                continue
            selecting = _prefilled(selector, i, prefix, self) if role == Role.SELECT else None
            layers.append(ForcedLayer(i, role, prefix, config, selecting, record))
        out = self.model(input_ids=chunk, **cache_kwargs(self.model, ForcedCache(layers)), use_cache=True)
        return ForcedResult(
            logits=out.logits.float(),
            per_layer_fraction=record.fraction,
            per_layer_recall=record.recall,
            per_head_recall=record.recall_heads,
            bytes_fetched=record.bytes,
            rows_fetched=record.rows,
            steps=chunk.shape[1],
            policy=config.policy,
            correction_rows=record.correction_rows,
            per_layer_correction=record.correction,
        )


def _prefilled(selector: Selector, index: int, prefix: Prefix, runner: ForcedRunner) -> LayerSelector:
    """`selector` bound to layer `index`, having seen the prefix's keys and prefill, as a
    decode after that prefill would have."""
    selecting = LayerSelector(selector, index)
    k_pre = prefix.cache.layers[index].keys
    selecting.append(k_pre, torch.ones(k_pre.shape[0], k_pre.shape[2], dtype=torch.bool, device=k_pre.device))
    selecting.prefill(_StoredWeights(runner, prefix, index))
    return selecting
