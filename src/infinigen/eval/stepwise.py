"""The step-by-step reference: teacher-forced decoding through the real decode path.

The model first prefills `prefix_len` tokens, then is fed the true next tokens one at a time,
exactly as `generate` would feed its own: every selection is made by the same code as in
generation. Slow (one forward per token); the tests prove the vectorized `Evaluator` equal to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from infinigen.api import attach
from infinigen.compat import cache_kwargs
from infinigen.config import InfiniGenConfig


@dataclass
class ForcedRun:
    logits: torch.Tensor  # [steps, vocab] next-token logits at each forced position
    summary: dict[str, Any] | None


@torch.no_grad()
def forced_logits(
    model,
    ids: torch.Tensor,
    prefix_len: int,
    steps: int,
    config: InfiniGenConfig | None = None,
    tokenizer=None,
    progress: bool = True,
    desc: str = "decode",
) -> ForcedRun:
    """Logits predicting ids[prefix_len + s + 1] for s in [0, steps): the first from the
    prefill, the rest from single-token decode steps. config=None: the unmodified model with a
    DynamicCache (the independent reference)."""
    if ids.dim() == 1:
        ids = ids[None]
    if prefix_len + steps > ids.shape[1]:
        raise ValueError(f"need {prefix_len + steps} tokens, got {ids.shape[1]}")
    if config is None:
        return ForcedRun(_step(model, ids, prefix_len, steps, DynamicCache(config=model.config), progress, desc), None)
    with attach(model, config, tokenizer=tokenizer, progress=progress) as session, session.new_cache() as cache:
        logits = _step(model, ids, prefix_len, steps, cache, progress, desc)
        return ForcedRun(logits, cache.summary())


def _step(model, ids, prefix_len: int, steps: int, cache, progress: bool, desc: str) -> torch.Tensor:
    out = model(input_ids=ids[:, :prefix_len], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    logits = [out.logits[0, -1].float()]
    for s in tqdm(range(1, steps), desc=desc, disable=not progress, leave=False):
        tok = ids[:, prefix_len + s - 1 : prefix_len + s]
        out = model(input_ids=tok, **cache_kwargs(model, cache), use_cache=True)
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits)
