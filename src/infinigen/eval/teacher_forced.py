"""Teacher-forced step-by-step decoding through the real decode path.

The model first prefills `prefix_len` tokens, then is fed the true next tokens one at a time,
exactly as `generate` would feed its own: every selection is made by the same code as in
generation. Used for top-1 agreement, recall and perplexity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from infinigen.cache import InfiniGenCache
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
    prefill, the rest from single-token decode steps. config=None: unmodified model with a
    DynamicCache (the independent reference)."""
    if ids.dim() == 1:
        ids = ids[None]
    if prefix_len + steps > ids.shape[1]:
        raise ValueError(f"need {prefix_len + steps} tokens, got {ids.shape[1]}")
    if config is None:
        from infinigen.attachment import detach

        detach(model)
        cache = DynamicCache(config=model.config)
    else:
        cache = InfiniGenCache(model, config, tokenizer=tokenizer, progress=progress)
    out = model(input_ids=ids[:, :prefix_len], past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = [out.logits[0, -1].float()]
    for s in tqdm(range(1, steps), desc=desc, disable=not progress, leave=False):
        tok = ids[:, prefix_len + s - 1 : prefix_len + s]
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1].float())
    summary = cache.summary() if isinstance(cache, InfiniGenCache) else None
    return ForcedRun(torch.stack(logits), summary)


def top1_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return torch.exp(torch.nn.functional.cross_entropy(logits.float(), targets)).item()


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p = torch.log_softmax(ref_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()
