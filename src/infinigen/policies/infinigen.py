"""`infinigen`: speculate layer i's attention from layer i-1's input (partial query of layer i
against the partial keys K̃ᵢ on the skewed channels), keep the positions within α of the top
and fetch only those — one layer ahead, so the fetch overlaps layer i-1 (Lee et al., OSDI 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinigen.policies.base import Policy
from infinigen.speculate import (
    Selection,
    aggregate_group,
    partial_projection,
    partial_scores,
    project_partial,
    select_blocks,
)


@dataclass
class PartialKeys:
    """K̃ of one layer: the keys on the partial channels, kept with the compute."""

    keys: torch.Tensor | None = None  # [B, Hkv, T, c]


class InfiniGenPolicy(Policy):
    name = "infinigen"
    selects = True
    query_from = "previous"

    def __init__(self, config, adapter, attachment=None) -> None:
        super().__init__(config, adapter, attachment)
        artifact = attachment.artifact if attachment is not None else None
        if artifact is None:
            raise ValueError("policy infinigen needs the skew artifact of an attachment")
        device = next(adapter.model.parameters()).device
        self.proj: dict[int, torch.Tensor] = {}
        for i in range(adapter.num_layers):
            # OPT: the skew is folded into the weights, so keys arrive already skewed.
            a = None if attachment.folded else artifact.skews.get(i)
            self.proj[i] = partial_projection(a, artifact.channels[i], adapter.head_dim).to(device)

    def alpha(self, layer_idx: int) -> float:
        return float(self.config.layer_alpha.get(layer_idx, self.config.alpha))

    def new_state(self, layer_idx: int) -> PartialKeys:
        return PartialKeys()

    def on_append(self, state: PartialKeys, layer_idx, keys, valid) -> None:
        kp = project_partial(keys, self.proj[layer_idx]).to(keys.dtype)  # scored every step: compute dtype
        state.keys = kp if state.keys is None else torch.cat([state.keys, kp], dim=-2)

    def scores(self, state: PartialKeys, layer_idx: int, query: torch.Tensor, past: int, valid) -> torch.Tensor:
        """Speculated group scores [B, Hkv, past] (-inf at padding)."""
        q_part = project_partial(query[:, :, None], self.proj[layer_idx])[:, :, 0]
        s = partial_scores(q_part, state.keys[:, :, :past], self.adapter.scaling(layer_idx))
        return aggregate_group(s, valid, self.adapter.num_kv_heads, self.config.aggregation)

    def select(self, state, layer_idx, query, past, valid, available=None) -> Selection:
        cfg = self.config
        g = self.scores(state, layer_idx, query, past, valid)
        return select_blocks(
            g, valid, cfg.block_tokens, self.alpha(layer_idx), cfg.budget, cfg.budget_tokens, cfg.min_tokens, available
        )

    def describe(self):
        c = self.config
        return {"policy": self.name, "alpha": c.alpha, "partial_ratio": c.partial_ratio, "skew": c.skew}
