"""`infinigen`: speculate layer i's attention from layer i-1's input (partial query of layer i
against the partial keys K̃ᵢ on the skewed channels), keep the positions within α of the top
and fetch only those — one layer ahead, so the fetch overlaps layer i-1 (Lee et al., OSDI 2024)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import infinigen.kernels as kernels
from infinigen.config import SpeculationKnobs
from infinigen.growing import GrowingTensor
from infinigen.select.base import Selector
from infinigen.speculate import (
    Selection,
    aggregate_group,
    is_all_valid,
    partial_projection,
    partial_scores,
    project_partial,
    select_blocks,
)


@dataclass
class PartialKeys:
    """K̃ of one layer: the keys on the partial channels, kept with the compute, stored
    channel-major ([B, Hkv, c, T]) so that scoring streams it contiguously, and grown in place."""

    buffer: GrowingTensor = field(default_factory=lambda: GrowingTensor(dim=-1))

    @property
    def keys(self) -> torch.Tensor | None:
        """[B, Hkv, T, c] (a transposed view)."""
        data = self.buffer.data
        return None if data is None else data.transpose(-1, -2)


class InfiniGenSelector(Selector):
    name = "infinigen"
    Knobs = SpeculationKnobs
    query_from = "previous"

    def __init__(self, knobs: SpeculationKnobs, adapter, projections: dict[int, torch.Tensor]) -> None:
        """projections: per layer, the skew columns of the partial channels [Hkv, d, c]
        (see `projections_from_artifact`)."""
        super().__init__(knobs, adapter)
        self.proj = projections

    def alpha(self, layer: int) -> float:
        return float(self.knobs.layer_alpha.get(layer, self.knobs.alpha))

    def new_state(self, layer: int) -> PartialKeys:
        return PartialKeys()

    def on_append(self, state: PartialKeys, layer, keys, valid) -> None:
        kp = project_partial(keys, self.proj[layer]).to(keys.dtype)  # scored every step: compute dtype
        state.buffer.append(kp.transpose(-1, -2))

    def scores(self, state: PartialKeys, layer: int, query: torch.Tensor, past: int, valid) -> torch.Tensor:
        """Speculated group scores [B, Hkv, past] (-inf where not valid)."""
        q_part = project_partial(query[:, :, None], self.proj[layer])[:, :, 0]
        s = partial_scores(q_part, state.keys[:, :, :past], self.adapter.scaling(layer))
        return aggregate_group(s, valid, self.adapter.num_kv_heads, self.knobs.aggregation)

    def select(self, state, layer, query, past, valid) -> Selection:
        k = self.knobs
        keys = state.buffer.full
        if k.block_tokens <= 1 and keys.dtype == torch.float32 and keys.device.type == "cpu" and kernels.available():
            # One call instead of a dozen tensor operations: the same rule (see infinigen.kernels).
            q_part = project_partial(query[:, :, None], self.proj[layer])[:, :, 0]
            q_scaled = q_part.to(torch.float32) * self.adapter.scaling(layer)
            idx, counts = kernels.select(
                keys, past, q_scaled, None if is_all_valid(valid) else valid, k.aggregation, self.alpha(layer),
                k.budget, k.budget_tokens, k.min_tokens,
            )  # fmt: skip
            slots = torch.arange(idx.shape[-1], device=idx.device)
            return Selection(idx, slots < counts[..., None])
        g = self.scores(state, layer, query, past, valid)
        return select_blocks(g, valid, k.block_tokens, self.alpha(layer), k.budget, k.budget_tokens, k.min_tokens)


def projections_from_artifact(artifact, head_dim: int, folded: bool, device) -> dict[int, torch.Tensor]:
    """Per layer, the projection onto the skewed partial channels, on `device` (one device, or
    {layer: device} for a model split across devices). For a model whose skew is folded into its
    weights (no RoPE: OPT), keys arrive already skewed: channels only."""
    out = {}
    for i, channels in artifact.channels.items():
        a = None if folded else artifact.skews.get(i)
        where = device.get(i, "cpu") if isinstance(device, dict) else device
        out[i] = partial_projection(a, channels, head_dim).to(where)
    return out
