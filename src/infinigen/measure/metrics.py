"""Quality of a policy's next-token logits against dense ones (and against the text itself)."""

from __future__ import annotations

import torch


def top1_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return torch.exp(torch.nn.functional.cross_entropy(logits.float(), targets)).item()


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p = torch.log_softmax(ref_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()
