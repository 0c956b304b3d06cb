"""Vectorized teacher-forced evaluation: S forced tokens through a policy in one forward pass.

Stepping a model through S decode steps costs S full forward passes. Under teacher forcing the
tokens are known, so the S steps can run as one chunk after a shared dense prefill — provided
every position attends exactly what the step-by-step decode would have let it attend. Per
layer, this module replays the policy's own calls in step order (`select` for position s from
the state after s-1 steps, `on_append` of s's key, `observe` of s's weights), builds the mask
row by row, and attends with the stored KV as the tier would return it (rounded to the storage
dtype, or int4-quantized; the current token's own K and V are exact, as in decode).
`tests/test_forced.py` checks logits, fractions, bytes and recall against the real decode path.

The prefill is dense for every policy (InfiniGen's prefill is), so one prefill per text serves
every policy; it is cropped back after each run.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from infinigen.cache import _DTYPES, attention_column_sums
from infinigen.config import InfiniGenConfig
from infinigen.models import ModelAdapter, get_adapter
from infinigen.policies import Policy, make_policy
from infinigen.speculate import attention_recall, selection_mask

FORCED_ATTN = "infinigen-forced"


@dataclass
class Prefix:
    """A dense prefill shared by every policy evaluated on the same text."""

    length: int
    cache: DynamicCache
    last_logits: torch.Tensor  # [B, V]: predicts the first forced token (dense for every policy)
    column_sums: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer, for h2o


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


class _Run:
    """What the hooks and the attention function share during one forward pass."""

    def __init__(self, adapter: ModelAdapter, policy: Policy | None, config: InfiniGenConfig | None, prefix_len: int):
        self.adapter = adapter
        self.policy = policy
        self.config = config
        self.prefix_len = prefix_len
        self.inputs: dict[int, tuple[torch.Tensor, Any]] = {}
        self.column_sums: dict[int, torch.Tensor] | None = None
        self.prefix_states: dict[int, Any] = {}
        self.fraction: dict[int, float] = {}
        self.recall: dict[int, float] = {}
        self.recall_heads: dict[int, list[float]] = {}
        self.bytes = 0
        self.rows = 0
        self.measure_recall = False


def _pre_hook(module: nn.Module, args, kwargs, layer_idx: int, run: _Run):
    x = kwargs.get("hidden_states", args[0] if args else None)
    run.inputs[layer_idx] = (x, kwargs.get("position_embeddings"))
    module._infinigen_forced = run
    return None


def forced_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    run: _Run | None = getattr(module, "_infinigen_forced", None)
    i = module.layer_idx
    sc = query.shape[-1] ** -0.5 if scaling is None else scaling
    if run is None or run.policy is None:  # prefill
        if run is not None and run.column_sums is not None:
            valid = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
            run.column_sums[i] = attention_column_sums(query, key, valid, sc)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    policy, cfg = run.policy, run.config
    selective = policy.selects and i >= cfg.dense_layers
    if policy.keeps_kv_on_compute or (selective is False and policy.selects and cfg.dense_layers_on_compute):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    return _fetched_attention(run, i, query, key, value, sc, selective)


def _fetched_attention(run: _Run, i: int, query, key, value, scaling: float, selective: bool):
    """Attention of S forced positions over the KV a tier would return, masked per position."""
    policy, cfg = run.policy, run.config
    b, h, s_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    g = h // hkv
    t0 = k_len - s_len
    kv_dtype = _DTYPES[cfg.kv_dtype] if cfg.kv_dtype else key.dtype
    k_st = policy.store(key, kv_dtype).to(torch.float32)
    v_st = policy.store(value, kv_dtype).to(torch.float32)
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
    row_bytes = policy.row_bytes(d, kv_dtype)
    if not selective:
        allowed = causal[None, None].expand(b, h, s_len, k_len)
        n_rows = b * hkv * int((t0 + rows).sum())
        run.rows += n_rows
        run.bytes += n_rows * row_bytes
    else:
        allowed = _replay_selection(run, i, scores, key, t0, s_len)[:, :, None].expand(b, hkv, g, s_len, k_len)
        allowed = allowed.reshape(b, h, s_len, k_len) | (cols[None, :] == self_col[:, None])[None, None]
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1)
    out = torch.matmul(probs, vr)
    p_self = probs[:, :, rows, self_col]  # [B, H, S]
    out = out + p_self[..., None] * (v_self - vr[:, :, t0:])  # the current token's exact V
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _replay_selection(run: _Run, i: int, scores: torch.Tensor, key: torch.Tensor, t0: int, s_len: int):
    """The policy's step-by-step selections of layer i for the S positions: [B, Hkv, S, K]."""
    policy, adapter = run.policy, run.adapter
    b, h = scores.shape[:2]
    hkv, k_len = key.shape[1], key.shape[2]
    state = run.prefix_states[i]
    valid = torch.ones(b, k_len, dtype=torch.bool, device=key.device)
    if policy.query_from is not None:
        x, pe = run.inputs[i - 1] if policy.query_from == "previous" else run.inputs[i]
        xf = x.to(torch.float32)
        queries = adapter.queries(i, xf, pe)  # [B, H, S, d]
    mask = torch.zeros(b, hkv, s_len, k_len, dtype=torch.bool, device=key.device)
    frac_sum, rec_sum = 0.0, torch.zeros(h, dtype=torch.float64)
    for s in range(s_len):
        past = t0 + s
        q = queries[:, :, s] if policy.query_from is not None else None
        sel = policy.select(state, i, q, past, valid[:, :past])
        mask[:, :, s, :past] = selection_mask(sel, past)
        policy.on_append(state, i, key[:, :, past : past + 1], valid[:, past : past + 1])
        if policy.observes:
            allowed = mask[:, :, s, : past + 1].clone()
            allowed[..., past] = True
            row = scores[:, :, s, : past + 1].masked_fill(~allowed.repeat_interleave(h // hkv, 1), -math.inf)
            p = torch.softmax(row, -1)
            idx = sel.indices.repeat_interleave(h // hkv, 1)
            policy.observe(state, i, sel, p.gather(-1, idx), p[..., past])
        frac_sum += sel.fraction()
        n = int(sel.valid.sum())
        run.rows += n
        run.bytes += n * policy.row_bytes(key.shape[-1], _kv_dtype(run, key))
        if run.measure_recall:
            true = torch.softmax(scores[:, :, s, :past], -1)
            rec_sum += attention_recall(true, sel).mean(0).to(torch.float64)
    run.fraction[i] = frac_sum / s_len
    if run.measure_recall:
        heads = rec_sum / s_len
        run.recall[i] = heads.mean().item()
        run.recall_heads[i] = heads.tolist()
    return mask


def _kv_dtype(run: _Run, key: torch.Tensor) -> torch.dtype:
    return _DTYPES[run.config.kv_dtype] if run.config.kv_dtype else key.dtype


def _restore(prefix: Prefix) -> None:
    """Cut every layer back to the prefix (also after a run that failed half-way)."""
    for layer in prefix.cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.shape[-2] > prefix.length:
            layer.keys = layer.keys[..., : prefix.length, :]
            layer.values = layer.values[..., : prefix.length, :]


def register_forced_attention() -> None:
    AttentionInterface.register(FORCED_ATTN, forced_attention)
    AttentionMaskInterface.register(FORCED_ATTN, sdpa_mask)


class ForcedEvaluator:
    """Teacher-forced evaluation of many policies on one text, sharing one dense prefill."""

    def __init__(self, model: nn.Module, tokenizer=None, progress: bool = False) -> None:
        self.model = model
        self.adapter = get_adapter(model)
        self.tokenizer = tokenizer
        self.progress = progress
        register_forced_attention()

    @contextmanager
    def _hooked(self, run: _Run):
        model = self.model
        orig = model.config._attn_implementation
        model.set_attn_implementation(FORCED_ATTN)
        handles = []
        import functools

        for i, mod in enumerate(self.adapter.attention_modules()):
            handles.append(
                mod.register_forward_pre_hook(functools.partial(_pre_hook, layer_idx=i, run=run), with_kwargs=True)
            )
        try:
            yield
        finally:
            for hd in handles:
                hd.remove()
            for mod in self.adapter.attention_modules():
                mod._infinigen_forced = None
            model.set_attn_implementation(orig)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, column_sums: bool = False) -> Prefix:
        """Dense prefill of ids [B, T0]; `column_sums` also keeps each layer's attention
        column sums (what h2o accumulates during a prefill)."""
        if ids.dim() == 1:
            ids = ids[None]
        run = _Run(self.adapter, None, None, ids.shape[1])
        run.column_sums = {} if column_sums else None
        cache = DynamicCache(config=self.model.config)
        with self._hooked(run):
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return Prefix(ids.shape[1], cache, out.logits[:, -1].float(), run.column_sums or {})

    @torch.no_grad()
    def run(
        self, prefix: Prefix, chunk: torch.Tensor, config: InfiniGenConfig, measure_recall: bool = False
    ) -> ForcedResult:
        """Logits after each token of `chunk` [B, S] when decoding under `config`'s policy."""
        if chunk.dim() == 1:
            chunk = chunk[None]
        attachment = None
        if config.policy == "infinigen":
            from infinigen.attachment import ensure_attached

            attachment = ensure_attached(self.model, config, tokenizer=self.tokenizer, progress=self.progress)
        policy = make_policy(config, self.adapter, attachment)
        if policy.prefill_scores and not prefix.column_sums:
            raise ValueError(f"policy {policy.name} needs a prefix prefilled with column_sums=True")
        run = _Run(self.adapter, policy, config, prefix.length)
        run.measure_recall = measure_recall and policy.selects
        for i in range(config.dense_layers, self.adapter.num_layers) if policy.selects else ():
            state = policy.new_state(i)
            k_pre = prefix.cache.layers[i].keys
            valid = torch.ones(k_pre.shape[0], k_pre.shape[2], dtype=torch.bool, device=k_pre.device)
            policy.on_append(state, i, k_pre, valid)
            if policy.prefill_scores:
                policy.on_prefill_attention(state, i, prefix.column_sums[i])
            run.prefix_states[i] = state
        try:
            with self._hooked(run):
                out = self.model(input_ids=chunk, past_key_values=prefix.cache, use_cache=True)
        finally:
            _restore(prefix)
        return ForcedResult(
            logits=out.logits.float(),
            per_layer_fraction=run.fraction,
            per_layer_recall=run.recall,
            per_head_recall=run.recall_heads,
            bytes_fetched=run.bytes,
            rows_fetched=run.rows,
            steps=chunk.shape[1],
            policy=config.policy,
        )
