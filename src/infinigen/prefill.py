"""A dense prefill in chunks: the prompt through the model `chunk` tokens per forward.

One forward over a long prompt holds its attention's working memory for every query at once
(sliding-window layers need an explicit [T, T] mask); chunks bound it, and with a cache that
keeps what earlier chunks computed the result is the same prefill."""

from __future__ import annotations

import torch

PREFILL_CHUNK = 4096  # prompt tokens per forward


@torch.no_grad()
def chunked_prefill(model, ids: torch.Tensor, cache, chunk: int = PREFILL_CHUNK, **kwargs):
    """Run ids [B, T] through `model` into `cache`, `chunk` tokens per forward; return the last
    forward's output (its logits are the last chunk's, `logits_to_keep` as given)."""
    out = None
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start : start + chunk], past_key_values=cache, use_cache=True, **kwargs)
    return out
