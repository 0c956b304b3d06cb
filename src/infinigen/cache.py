"""InfiniGenCache (a transformers Cache), the attention function and the hooks that drive it.

The cache drives a selection policy (`infinigen.policies`): InfiniGen by default, or one of the
baselines, through the same steps and the same byte counters. For InfiniGen, per decode step t
and every layer i:
  * the pre-hook of layer i-1's attention sees i-1's normalized input x and speculates layer
    i: partial query of layer i from x, partial scores against K̃ᵢ, threshold/budget selection;
    it then issues the gather of the selected rows of layer i from the slow tier (prefetch);
  * layer i's `update` appends the new k, v to the tier and the skewed partial k to K̃ᵢ, and
    returns the prefetched rows plus the new token;
  * the "infinigen" attention function attends over exactly that set.
Prefill is dense: every layer's KV streams into its tier and K̃ is built as it goes.
Policies that need the true query of layer i (quest, oracle) select in layer i's own pre-hook
instead, so their fetch cannot overlap; h2o and streaming need no query and are issued ahead.
"""

from __future__ import annotations

import math
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from infinigen.config import InfiniGenConfig
from infinigen.kv import KVTier, TransferStats, make_tier
from infinigen.kv.pool import HostPool, capacity_slots
from infinigen.kv.tiers import SlotRamTier
from infinigen.models import ModelAdapter
from infinigen.policies import Policy, make_policy
from infinigen.policies.base import group_sum
from infinigen.skew import SkewArtifact
from infinigen.speculate import Selection, attention_recall

ATTN_NAME = "infinigen"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ContextTooLongError(ValueError):
    """The prompt (plus what will be generated) does not fit the model's context."""


@dataclass
class LayerStats:
    """Decode-time statistics of one layer (selection fraction, recall)."""

    steps: int = 0
    fraction_sum: float = 0.0
    recall_sum: float = 0.0
    recall_n: int = 0
    wait_seconds: float = 0.0


class InfiniGenLayer(CacheLayerMixin):
    """One layer's state: the slow tier, K̃ (partial keys, on the compute device), the
    prefetched selection for the coming step and what the attention function must attend."""

    is_compileable = False
    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.tier: KVTier | None = None
        self.dense_k: torch.Tensor | None = None  # policy "dense": the whole KV with the compute
        self.dense_v: torch.Tensor | None = None
        self.state: Any = None  # what the policy remembers about this layer (K̃ for InfiniGen)
        self.prefetched: tuple[Selection | None, Future] | None = None  # issued, not yet waited on
        self.attend_valid: torch.Tensor | None = None  # [B, Hkv, n+1] for the attention function
        self.selection: Selection | None = None
        self.pool: HostPool | None = None
        self.length = 0
        self.stats = LayerStats()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):  # driven by InfiniGenCache.update
        raise RuntimeError("InfiniGenLayer is updated through InfiniGenCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__()


class InfiniGenCache(Cache):
    """KV cache whose full contents live in a slow tier; decode fetches only selected rows.

    Use as ``model.generate(..., past_key_values=InfiniGenCache(model, config))`` or get one
    from ``infinigen.attach(model, config).new_cache()``. One cache serves one generation.
    """

    def __init__(
        self,
        model: nn.Module,
        config: InfiniGenConfig | None = None,
        skew: SkewArtifact | str | None = None,
        tokenizer=None,
        progress: bool = True,
    ) -> None:
        from infinigen.attachment import ensure_attached

        self.ig_config = config or InfiniGenConfig()
        self.attachment = ensure_attached(model, self.ig_config, skew=skew, tokenizer=tokenizer, progress=progress)
        self.adapter: ModelAdapter = self.attachment.adapter
        self.artifact: SkewArtifact | None = self.attachment.artifact
        n = self.adapter.num_layers
        super().__init__(layers=[InfiniGenLayer() for _ in range(n)])
        self.transfer = TransferStats()
        self.key_valid: torch.Tensor | None = None  # [B, T]: False at padding
        self.decode_steps = 0
        self.prefill_tokens = 0
        self.batch = 0
        self.speculation_seconds = 0.0
        self.wait_seconds = 0.0
        self._pools = None
        self._pool_finalizer = None
        self.selector: Policy = make_policy(self.ig_config, self.adapter, self.attachment)
        for i, layer in enumerate(self.layers):
            if self.is_speculated(i):
                layer.state = self.selector.new_state(i)

    # ------------------------------------------------------------------ helpers
    @property
    def policy(self) -> str:
        return self.ig_config.policy

    def is_speculated(self, layer_idx: int) -> bool:
        """Whether this layer fetches a selection (speculated, for InfiniGen) rather than every row."""
        return self.selector.selects and layer_idx >= self.ig_config.dense_layers

    def on_compute(self, layer_idx: int) -> bool:
        """Whether this layer's whole KV stays with the compute (policy dense, or the
        non-selecting first layers of a selecting policy when `dense_layers_on_compute`)."""
        if self.selector.keeps_kv_on_compute:
            return True
        cfg = self.ig_config
        return self.selector.selects and cfg.dense_layers_on_compute and layer_idx < cfg.dense_layers

    def _pooled(self, layer_idx: int) -> bool:
        """Speculated layers keep a capped host pool when host_capacity < 1 (dense layers
        read every row, so they keep everything)."""
        return self.ig_config.host_capacity < 1 and self.is_speculated(layer_idx)

    def _kv_dtype(self, compute: torch.dtype) -> torch.dtype:
        return _DTYPES[self.ig_config.kv_dtype] if self.ig_config.kv_dtype else compute

    def observe_mask(self, attention_mask: torch.Tensor | None, batch: int, kv_len: int, device) -> None:
        """Record which cached positions are real tokens (left padding never counts)."""
        if attention_mask is None or attention_mask.dim() != 4:
            valid = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
        elif attention_mask.dtype == torch.bool:
            valid = attention_mask[:, 0, -1, :kv_len]
        else:
            valid = attention_mask[:, 0, -1, :kv_len] > torch.finfo(attention_mask.dtype).min / 2
        if valid.shape[0] != batch:
            valid = valid.expand(batch, -1)
        self.key_valid = valid

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, layer_idx: int, x: torch.Tensor, position_embeddings, own: bool = False) -> None:
        """Issue layer_idx's fetch for the coming decode step. Called with layer_idx-1's
        normalized attention input (own=False: the transfer runs while layer_idx-1 computes)
        and again with layer_idx's own (own=True), which issues what could not go ahead: layer
        0, and the selections of policies that need layer_idx's true query."""
        layer = self.layers[layer_idx]
        if layer.tier is None or layer.length == 0 or layer.prefetched is not None:
            return
        if self.is_speculated(layer_idx):
            if self.selector.query_from == "own" and not own:
                return
            self.select(layer_idx, x, position_embeddings)
        else:
            fut = layer.tier.read_all_async(layer.length, x.device, layer.dtype)
            layer.prefetched = (None, fut)

    @torch.no_grad()
    def select(self, layer_idx: int, x: torch.Tensor, position_embeddings) -> None:
        """Ask the policy which of layer_idx's rows the coming step needs (x: the normalized
        attention input its query comes from) and issue their fetch from the tier."""
        layer = self.layers[layer_idx]
        if layer.length == 0:
            return
        start = time.perf_counter()
        past = layer.length
        q = None
        if self.selector.query_from is not None:
            xf = x.to(torch.float32) if x.dtype != torch.float32 else x
            q = self.adapter.queries(layer_idx, xf, position_embeddings)[:, :, -1]
        valid = self.key_valid[:, :past]
        if layer.pool is not None:
            available = layer.pool.resident(past).to(valid.device)
            sel = self.selector.select(layer.state, layer_idx, q, past, valid, available=available)
        else:
            sel = self.selector.select(layer.state, layer_idx, q, past, valid)
        rows = sel.indices
        if layer.pool is not None:
            layer.pool.record_fetch(sel.indices.cpu(), sel.valid.cpu(), self.decode_steps)
            rows = layer.pool.slots_of(sel.indices.cpu(), sel.valid.cpu()).to(sel.indices.device)
        self.speculation_seconds += time.perf_counter() - start
        layer.prefetched = (sel, layer.tier.gather_async(rows, sel.valid, x.device, layer.dtype))

    def _wait(self, layer: InfiniGenLayer, fut) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        out = fut.result()
        waited = time.perf_counter() - start
        layer.stats.wait_seconds += waited
        self.wait_seconds += waited
        return out

    @property
    def _device(self) -> torch.device:
        return next(self.adapter.model.parameters()).device

    def _new_tier(self, b: int, hkv: int, d: int, dtype: torch.dtype) -> KVTier:
        cfg = self.ig_config
        return make_tier(
            cfg.tier,
            b,
            hkv,
            d,
            self._kv_dtype(dtype),
            self.transfer,
            capacity=self.adapter.max_positions,
            directory=cfg.kv_dir,
            threads=cfg.io_threads,
            device=self._device,
            pools=self._shared_pools() if cfg.tier == "disk" else None,
        )

    def _shared_pools(self):
        """One gather thread and `io_threads` readers for all layers of this cache."""
        if self._pools is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pools = (
                ThreadPoolExecutor(1, thread_name_prefix="infinigen-gather"),
                ThreadPoolExecutor(self.ig_config.io_threads, thread_name_prefix="infinigen-io"),
            )
            self._pool_finalizer = weakref.finalize(self, _shutdown_pools, self._pools)
        return self._pools

    def _preflight(self, b: int, hkv: int, d: int, dtype: torch.dtype) -> None:
        """Before the first KV byte is written: room for every layer's file on the disk tier."""
        if self.ig_config.tier != "disk":
            return
        from infinigen.kv.disk import check_space

        itemsize = torch.empty((), dtype=self._kv_dtype(dtype)).element_size()
        per_layer = b * hkv * self.adapter.max_positions * 2 * d * itemsize
        tiered = sum(not self.on_compute(i) for i in range(len(self.layers)))
        check_space(self.ig_config.kv_dir, per_layer * tiered)

    # ------------------------------------------------------------------ Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        b, hkv, q_len, d = key_states.shape
        past = layer.length
        layer.attend_valid = None
        layer.selection = None
        limit = self.adapter.max_positions
        if past + q_len > limit:
            raise ContextTooLongError(
                f"{past + q_len} tokens exceed the model's context of {limit} positions"
                + (" (the prompt alone is too long)" if past == 0 else "")
            )
        sliding = self.adapter.sliding_window
        if sliding is not None and past + q_len > sliding:
            raise ContextTooLongError(
                f"context of {past + q_len} tokens exceeds the model's sliding window ({sliding}); "
                "sliding-window attention is not supported"
            )
        if layer_idx == 0:
            if past == 0:
                self.prefill_tokens = q_len
                self.batch = b
                if self.policy != "dense":
                    self._preflight(b, hkv, d, key_states.dtype)
            elif q_len == 1:
                self.decode_steps += 1

        if self.on_compute(layer_idx):
            if past == 0:
                layer.dense_k, layer.dense_v = key_states, value_states
            else:
                layer.dense_k = torch.cat([layer.dense_k, key_states], dim=-2)
                layer.dense_v = torch.cat([layer.dense_v, value_states], dim=-2)
            layer.length += q_len
            return layer.dense_k, layer.dense_v

        # Resolve this layer's transfer first: the tier is never written while it is read.
        prefetched, layer.prefetched = layer.prefetched, None
        if past > 0 and (q_len > 1 or prefetched is None):
            prefetched = (None, layer.tier.read_all_async(past, key_states.device, key_states.dtype))
        fetched = self._wait(layer, prefetched[1]) if prefetched is not None and past > 0 else None

        if layer.tier is None:
            if self._pooled(layer_idx):
                slots = capacity_slots(self.ig_config.host_capacity, q_len)
                layer.pool = HostPool(b, hkv, slots, self.ig_config.eviction)
                layer.tier = SlotRamTier(b, hkv, d, self._kv_dtype(key_states.dtype), self.transfer, slots)
            else:
                kv_dtype = self._kv_dtype(key_states.dtype)
                layer.tier = self.selector.make_tier(
                    b, hkv, d, kv_dtype, self.transfer, default=lambda: self._new_tier(b, hkv, d, key_states.dtype)
                )
        if layer.pool is not None:
            new_valid = self.key_valid[:, past : past + q_len] if self.key_valid is not None else None
            slots, _ = layer.pool.admit(q_len, None if new_valid is None else new_valid.cpu())
            layer.tier.write(slots, key_states, value_states)
        else:
            layer.tier.append(key_states, value_states)
        if self.is_speculated(layer_idx):
            if self.key_valid is not None:
                new_valid = self.key_valid[:, past : past + q_len]
            else:
                new_valid = torch.ones(b, q_len, dtype=torch.bool, device=key_states.device)
            self.selector.on_append(layer.state, layer_idx, key_states, new_valid)
        layer.length += q_len

        if fetched is None:
            return key_states, value_states  # prefill: dense, from the freshly computed KV
        k_old, v_old = fetched
        sel = prefetched[0]
        if sel is None:
            # Layers < dense_layers, the full-fetch policy, and chunked prefill read every row.
            if q_len == 1:
                layer.stats.steps += 1
                layer.stats.fraction_sum += 1.0
            return torch.cat([k_old.to(key_states.dtype), key_states], dim=-2), torch.cat(
                [v_old.to(value_states.dtype), value_states], dim=-2
            )
        layer.selection = sel
        layer.attend_valid = torch.cat(
            [sel.valid, torch.ones(b, hkv, 1, dtype=torch.bool, device=sel.valid.device)], -1
        )
        frac = sel.fraction()
        layer.stats.steps += 1
        layer.stats.fraction_sum += frac
        return torch.cat([k_old.to(key_states.dtype), key_states], dim=-2), torch.cat(
            [v_old.to(value_states.dtype), value_states], dim=-2
        )

    def close(self) -> None:
        """Release the tiers (remove disk files); the cache is unusable afterwards."""
        for layer in self.layers:
            if layer.prefetched is not None:
                try:
                    layer.prefetched[1].result()
                except Exception:
                    pass
                layer.prefetched = None
            if layer.tier is not None:
                layer.tier.close()
                layer.tier = None
        if self._pool_finalizer is not None:
            self._pool_finalizer()
            self._pools = self._pool_finalizer = None

    def __enter__(self) -> InfiniGenCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("InfiniGenCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("InfiniGenCache does not support num_return_sequences > 1")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("InfiniGenCache does not support cropping (assisted decoding)")

    # ------------------------------------------------------------------ reporting
    def _amplification(self) -> float | None:
        useful = sum(getattr(layer.tier, "bytes_useful", 0) for layer in self.layers if layer.tier is not None)
        read = sum(getattr(layer.tier, "bytes_read", 0) for layer in self.layers if layer.tier is not None)
        if self.ig_config.tier == "ram":
            return 1.0 if self.transfer.bytes else None
        return read / useful if useful else None

    def summary(self) -> dict[str, Any]:
        """What this generation moved and selected (decode steps only)."""
        spec = [i for i in range(len(self.layers)) if self.is_speculated(i)]
        fr = [
            self.layers[i].stats.fraction_sum / self.layers[i].stats.steps for i in spec if self.layers[i].stats.steps
        ]
        rec = [
            self.layers[i].stats.recall_sum / self.layers[i].stats.recall_n
            for i in spec
            if self.layers[i].stats.recall_n
        ]
        per_layer = []
        for i, layer in enumerate(self.layers):
            s = layer.stats
            per_layer.append(
                {
                    "layer": i,
                    "speculated": self.is_speculated(i),
                    "fetched_fraction": (s.fraction_sum / s.steps) if s.steps else None,
                    "recall": (s.recall_sum / s.recall_n) if s.recall_n else None,
                    "wait_seconds": s.wait_seconds,
                }
            )
        tokens = max(self.decode_steps, 1) * max(self.batch, 1)
        if self.selector.keeps_kv_on_compute:
            fetched = None
        elif not self.selector.selects:
            fetched = 1.0
        else:
            fetched = sum(fr) / len(fr) if fr else None
        return {
            "policy": self.policy,
            "policy_settings": self.selector.describe(),
            "decode_steps": self.decode_steps,
            "prefill_tokens": self.prefill_tokens,
            "batch": self.batch,
            "fetched_fraction": fetched,
            "recall": sum(rec) / len(rec) if rec else None,
            "bytes_fetched": self.transfer.bytes,
            "rows_fetched": self.transfer.rows,
            "bytes_fetched_per_token": self.transfer.bytes / tokens if self.decode_steps else 0.0,
            "speculation_seconds": self.speculation_seconds,
            "wait_seconds": self.wait_seconds,
            "tier": self.ig_config.tier,
            "evictions": sum(layer.pool.evictions for layer in self.layers if layer.pool is not None),
            "host_capacity": self.ig_config.host_capacity,
            "read_amplification": self._amplification(),
            "per_layer": per_layer,
        }


def _shutdown_pools(pools) -> None:
    for pool in pools:
        pool.shutdown(wait=True)


# ---------------------------------------------------------------------- attention function
def infinigen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """Attention over the selected rows when the cache selected some; otherwise sdpa."""
    cache = getattr(module, "_infinigen_cache", None)
    layer = cache.layers[module.layer_idx] if isinstance(cache, InfiniGenCache) else None
    if layer is None or layer.attend_valid is None:
        if (
            layer is not None
            and query.shape[2] > 1
            and cache.selector.prefill_scores
            and cache.is_speculated(module.layer_idx)
        ):
            sc = query.shape[-1] ** -0.5 if scaling is None else scaling
            valid = cache.key_valid[:, : key.shape[2]]
            colsum = attention_column_sums(query, key, valid, sc)
            cache.selector.on_prefill_attention(layer.state, module.layer_idx, colsum)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    b, h, q_len, d = query.shape
    hkv = key.shape[1]
    scaling = d**-0.5 if scaling is None else scaling
    k = key.repeat_interleave(h // hkv, dim=1).to(torch.float32)
    v = value.repeat_interleave(h // hkv, dim=1).to(torch.float32)
    valid = layer.attend_valid.repeat_interleave(h // hkv, dim=1)[:, :, None, :]
    scores = torch.matmul(query.to(torch.float32), k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~valid, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v).to(query.dtype)
    if cache.selector.observes and layer.selection is not None:
        p = probs[:, :, -1]
        cache.selector.observe(layer.state, module.layer_idx, layer.selection, p[..., :-1], p[..., -1])
    if cache.ig_config.measure_recall and layer.selection is not None and layer.pool is None:
        _record_recall(cache, module.layer_idx, query, scaling)
    return out.transpose(1, 2).contiguous(), None


def _record_recall(cache: InfiniGenCache, layer_idx: int, query: torch.Tensor, scaling: float) -> None:
    """Attention mass of the selection under the true (dense) attention — evaluation only."""
    layer = cache.layers[layer_idx]
    k_all, _ = layer.tier.peek_all()
    past = layer.length - 1
    h = query.shape[1]
    k = k_all[:, :, :past].to(query.device, torch.float32).repeat_interleave(h // k_all.shape[1], dim=1)
    # Softmax over all cached positions and the current token; recall counts cached ones only.
    scores = torch.matmul(query[:, :, -1:].to(torch.float32), k.transpose(-1, -2))[:, :, 0] * scaling
    pad = ~cache.key_valid[:, None, :past]
    scores = scores.masked_fill(pad, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    rec = attention_recall(probs, layer.selection)
    layer.stats.recall_sum += rec.mean().item()
    layer.stats.recall_n += 1


def attention_column_sums(
    query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor, scaling: float, chunk: int = 256
) -> torch.Tensor:
    """Causal attention weights of a prefill, summed over its real queries and each GQA
    group's heads: query [B, H, Q, d] (the last Q of the K positions), key [B, Hkv, K, d],
    valid [B, K] -> [B, Hkv, K]. Chunked over queries to bound memory."""
    b, h, q_len, _ = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    offset = k_len - q_len
    k = key.to(torch.float32).repeat_interleave(h // hkv, dim=1)
    out = torch.zeros(b, hkv, k_len, dtype=torch.float32, device=query.device)
    cols = torch.arange(k_len, device=query.device)
    for r0 in range(0, q_len, chunk):
        r1 = min(q_len, r0 + chunk)
        rows = torch.arange(offset + r0, offset + r1, device=query.device)
        s = torch.matmul(query[:, :, r0:r1].to(torch.float32), k.transpose(-1, -2)) * scaling
        allowed = (cols[None, :] <= rows[:, None])[None, None] & valid[:, None, None, :]
        probs = torch.softmax(s.masked_fill(~allowed, -math.inf), -1)
        real_rows = valid[:, offset + r0 : offset + r1][:, None, :, None]
        probs = torch.where(real_rows & allowed.any(-1, keepdim=True), probs, torch.zeros_like(probs))
        out += group_sum(probs.sum(2), hkv)
    return out


def register_attention() -> None:
    """Make "infinigen" a valid attn_implementation (idempotent)."""
    AttentionInterface.register(ATTN_NAME, infinigen_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
