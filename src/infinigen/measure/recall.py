"""Recall: the share of the true (dense) attention mass a step's selection captured.

Evaluation, not decoding: the runtime only offers each decode step to an observer
(`infinigen.layers.AttendObserver`) when one is set, and `RecallObserver` is that observer. The
forced evaluator, which has every position's true scores at hand, accumulates per head with
`HeadRecall`. Both measure `attention_recall` over the stored keys of the past positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from infinigen.speculate import Selection, attention_recall


class RecallObserver:
    """Per layer, the mean over decode steps of the selection's recall (averaged over batch rows
    and query heads), reported as that layer's ``recall`` in `summary()`. Attach one to a cache
    (`cache.observer = RecallObserver()`; an attach session does when the config asks, through
    `recall_observer_for`)."""

    def __init__(self) -> None:
        self._sum: dict[int, float] = {}
        self._steps: dict[int, int] = {}

    def on_attend(
        self,
        layer: int,
        query: torch.Tensor,
        selection: Selection,
        keys: torch.Tensor,
        real: torch.Tensor,
        scaling: float,
    ) -> None:
        """The true softmax over every stored past position (padding excluded); its mass on the
        selection's positions over its mass on the past (the current token is always attended)."""
        h = query.shape[1]
        k = keys.to(query.device, torch.float32).repeat_interleave(h // keys.shape[1], dim=1)
        scores = torch.matmul(query[:, :, -1:].to(torch.float32), k.transpose(-1, -2))[:, :, 0] * scaling
        probs = torch.softmax(scores.masked_fill(~real[:, None, :], -math.inf), dim=-1)
        self._sum[layer] = self._sum.get(layer, 0.0) + attention_recall(probs, selection).mean().item()
        self._steps[layer] = self._steps.get(layer, 0) + 1

    def recall(self, layer: int) -> float | None:
        steps = self._steps.get(layer, 0)
        return self._sum[layer] / steps if steps else None

    def report(self, layer: int) -> dict[str, Any]:
        return {"recall": self.recall(layer)}


def recall_observer_for(config) -> RecallObserver | None:
    """The observer `config` asks for: recall when ``measure_recall`` is set, else none (the one
    place that turns the knob into an observer; whoever makes caches from a config calls it)."""
    return RecallObserver() if config.measure_recall else None


class HeadRecall:
    """One layer's recall per query head, averaged over the steps added (the forced evaluator's:
    it has the true weights of every step at once)."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._steps = 0

    def add(self, true_probs: torch.Tensor, selection: Selection) -> None:
        """true_probs [B, H, past]: the true softmax over the past positions of one step."""
        heads = attention_recall(true_probs, selection).mean(0).to(torch.float64)
        self._sum = heads if self._sum is None else self._sum + heads
        self._steps += 1

    def per_head(self) -> torch.Tensor:
        """[H]: the mean over the steps added."""
        return self._sum / self._steps
