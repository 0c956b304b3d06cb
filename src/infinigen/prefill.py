"""A dense prefill in chunks: the prompt through the model `chunk` tokens per forward.

One forward over a long prompt holds its attention's working memory for every query at once
(sliding-window layers need an explicit [T, T] mask); chunks bound it, and with a cache that
keeps what earlier chunks computed the result is the same prefill."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from infinigen.compat import cache_kwargs

PREFILL_CHUNK = 4096  # prompt tokens per forward


@torch.no_grad()
def chunked_prefill(model, ids: torch.Tensor, cache, chunk: int = PREFILL_CHUNK, progress: bool = False, **kwargs):
    """Run ids [B, T] through `model` into `cache`, `chunk` tokens per forward; return the last
    forward's output (its logits are the last chunk's, `logits_to_keep` as given). With
    `progress`, a prompt of more than one chunk (minutes on a CPU) shows a "prefill" bar on
    stderr, gone once done."""
    total = ids.shape[1]
    out = None
    with tqdm(
        total=total, desc="prefill", unit="tok", file=sys.stderr, leave=False, disable=not progress or total <= chunk
    ) as bar:
        for start in range(0, total, chunk):
            out = model(input_ids=ids[:, start : start + chunk], **cache_kwargs(model, cache), use_cache=True, **kwargs)
            bar.update(min(chunk, total - start))
    return out


@dataclass
class Prefix:
    """A prompt's KV computed once by the plain model, to replay into other caches.

    Every policy whose prefill attends densely (its selector does not watch the prefill's
    attention, `Selector.watches_prefill`) computes this KV from the same prompt (a later prefill
    chunk attends to the earlier ones as stored, so up to the storage dtype's rounding there), so
    one prefill can stand in for each of theirs: a side-by-side run of several policies, or a batch
    of one prompt repeated, pays for it once. layers: per layer (keys, values) [1, Hkv, n, d] as
    computed (a sliding-window layer's: its window); next_token: the greedy token after it; ids:
    the tokens [1, n] it was computed from (None when they were not kept); seconds: its prefill;
    column_sums: per global layer, the prompt's attention column sums [1, Hkv, n]
    (`infinigen.generation.prompt_column_sums`), which a policy that watches the prefill
    (H2O) is handed at the replay in place of its own prefill's; None when not computed."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    length: int
    next_token: torch.Tensor
    seconds: float
    ids: torch.Tensor | None = None
    column_sums: dict[int, torch.Tensor] | None = None

    def replay(self, cache, batch: int = 1) -> None:
        """Store the prefix into `cache` (empty) for `batch` identical rows, layer by layer, as a
        prefill would store it; with `column_sums`, hand each layer's to the cache
        (`InfiniGenCache.prefill_attention`) as its prefill's attention would be."""
        if cache.get_seq_length() != 0:
            raise ValueError("a prefix is replayed into an empty cache only")
        for i, (k, v) in enumerate(self.layers):
            k = whole_context(k, self.length).expand(batch, -1, -1, -1).contiguous()
            v = whole_context(v, self.length).expand(batch, -1, -1, -1).contiguous()
            cache.update(k, v, i)
            del k, v
            if self.column_sums is not None and i in self.column_sums:
                cache.prefill_attention(i, ColumnSums(self.column_sums[i], batch))


class ColumnSums:
    """A prefill's attention as a selector asks for it (`select.base.PrefillWeights`), from
    column sums computed once for one row and shared by `batch` identical rows."""

    def __init__(self, sums: torch.Tensor, batch: int) -> None:
        self._sums, self._batch = sums, batch

    def column_sums(self) -> torch.Tensor:
        return self._sums.expand(self._batch, -1, -1)


@torch.no_grad()
def dense_prefix(model, ids: torch.Tensor, progress: bool = False) -> Prefix:
    """Prefill `ids` [1, T] with the plain model in chunks (transformers' own cache) and keep
    every layer's KV as computed."""
    from transformers import DynamicCache

    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"a prefix is one row of at least one token, got ids of shape {tuple(ids.shape)}")
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    out = chunked_prefill(model, ids, cache, logits_to_keep=1, progress=progress)
    seconds = time.perf_counter() - start
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    return Prefix(layers, int(ids.shape[1]), out.logits[:, -1].argmax(-1), seconds, ids.clone())


def whole_context(saved: torch.Tensor, context: int) -> torch.Tensor:
    """A layer's KV [B, Hkv, n, d] in fp32, as `context` positions: a sliding-window layer kept
    only its window, placed at the end (the positions before it are outside every later window,
    and zero)."""
    saved = saved.to(torch.float32)
    n = saved.shape[2]
    if n == context:
        return saved
    whole = saved.new_zeros(*saved.shape[:2], context, saved.shape[3])
    whole[:, :, context - n :] = saved
    return whole
