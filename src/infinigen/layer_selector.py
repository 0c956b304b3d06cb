"""A selector bound to one layer: the calls of a decode step, spelled once.

The runtime layer (`layers.OffloadedLayer`, one step at a time) and the forced evaluator
(`measure.forced.ForcedLayer`, S teacher-forced steps replayed in order) make the same calls in the
same order (`Selector`'s docstring): the query from the input its `query_from` names, `select`,
`append` of the step's key, `top_up` with the layer's own query, `observe` of the weights. Both go
through this class, so a rule such as "an empty correction is no correction" or "the speculated
query is computed in fp32" has one owner and the evaluator cannot drift from the decode path.
"""

from __future__ import annotations

from typing import Any

import torch

from infinigen.growing import GrowingTensor
from infinigen.select.base import PrefillWeights, Selector, held_bytes
from infinigen.speculate import Selection


class LayerSelector:
    """`selector`'s calls for layer `index`, with the state it keeps for that layer."""

    def __init__(self, selector: Selector, index: int, reserve: int | None = None) -> None:
        """reserve: the positions the generation will reach, if known: the state's growing
        buffers make room for them at once (what `budget.estimate` plans with)."""
        self.selector, self.index = selector, index
        self.state: Any = selector.new_state(index)
        if reserve is not None and self.state is not None:
            for value in vars(self.state).values():
                if isinstance(value, GrowingTensor):
                    value.capacity = reserve

    @property
    def query_from(self) -> str | None:
        """Which layer's input the query comes from (see `Selector.query_from`)."""
        return self.selector.query_from

    @property
    def observes(self) -> bool:
        return self.selector.observes

    def query(self, x: torch.Tensor, position_embeddings) -> torch.Tensor | None:
        """The queries `select` takes, [B, H, T, d], from the normalized input x [B, T, D] (in
        fp32: the selection must not depend on the model's compute dtype); None if it takes none."""
        if self.selector.query_from is None:
            return None
        xf = x if x.dtype == torch.float32 else x.to(torch.float32)
        return self.selector.query(self.index, xf, position_embeddings)

    def last_query(self, x: torch.Tensor, position_embeddings, device) -> torch.Tensor | None:
        """The last position's query `select` takes [B, H, d], from an input that may come from
        the previous layer's device; None if it takes none."""
        if self.selector.query_from is None:
            return None
        if x.device != device:  # the previous layer computes on another device
            x = x.to(device)
            if position_embeddings is not None:
                position_embeddings = tuple(t.to(device) for t in position_embeddings)
        return self.query(x, position_embeddings)[:, :, -1]

    def select(self, query: torch.Tensor | None, past: int, valid: torch.Tensor) -> Selection:
        """The positions of [0, past) the coming step attends (query [B, H, d] or None)."""
        return self.selector.select(self.state, self.index, query, past, valid)

    def append(self, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """New positions' keys [B, Hkv, n, d]; valid [B, n]."""
        self.selector.on_append(self.state, self.index, keys, valid)

    def prefill(self, weights: PrefillWeights) -> None:
        self.selector.on_prefill(self.state, self.index, weights)

    def top_up(self, query: torch.Tensor, past: int, valid: torch.Tensor, selection: Selection) -> Selection | None:
        """Positions to fetch besides `selection`, chosen with the layer's own query [B, H, d];
        None when the selector adds nothing (it answered None, or an empty selection)."""
        extra = self.selector.correct(self.state, self.index, query, past, valid, selection)
        return None if extra is None or extra.indices.shape[-1] == 0 else extra

    def observe(self, selection: Selection, probs: torch.Tensor, self_prob: torch.Tensor) -> None:
        """The step's weights: probs [B, H, n] on the selection's slots, self_prob [B, H]."""
        self.selector.observe(self.state, self.index, selection, probs, self_prob)

    def held_bytes(self) -> int:
        """Bytes its state keeps with the compute (see `held_bytes`)."""
        return held_bytes(self.state)


def with_top_up(selection: Selection, extra: Selection) -> Selection:
    """The step's whole selection: the first transfer's slots, then the top-up's."""
    return Selection(torch.cat([selection.indices, extra.indices], -1), torch.cat([selection.valid, extra.valid], -1))
