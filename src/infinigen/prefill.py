"""A dense prefill in chunks: the prompt through the model `chunk` tokens per forward.

One forward over a long prompt holds its attention's working memory for every query at once
(sliding-window layers need an explicit [T, T] mask); chunks bound it, and with a cache that
keeps what earlier chunks computed the result is the same prefill."""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

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
            out = model(input_ids=ids[:, start : start + chunk], past_key_values=cache, use_cache=True, **kwargs)
            bar.update(min(chunk, total - start))
    return out
