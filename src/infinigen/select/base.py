"""The one question every selector answers: which cached positions of layer i does this decode
step need? InfiniGen and every selecting baseline implement it here, so the cache, the evaluator
and the benchmark drive them all through the same calls.

A selector is stateless; what it remembers about a layer (partial keys, page bounds, accumulated
attention) lives in a per-layer state object it creates, so that one selector serves every layer
of a cache and the evaluator can replay the exact same calls.

Call order for one layer: `on_append` of the prefill's keys, `on_prefill`; then per decode step
`select` (for the coming step, before its key exists), `on_append` of the step's key, `correct`
(the layer's own query has arrived: a small second selection, fetched as a second transfer, or
None), `observe` of the step's attention weights.

A selector's file also declares its settings and what its policy means, so that adding a policy
is one file here and one line in `SELECTORS` (`infinigen.select`): its `Knobs` (a dataclass of
`infinigen.validation.knob` fields on top of `SelectionBudget`, which every selector shares) and
its `policy` (a `PolicySpec`). `infinigen.config` reads them from the registry: the knobs become
fields of `InfiniGenConfig` (flags, `eval --set` values and docs/settings.md follow), the spec an
entry of `POLICIES`. Nothing here imports the config: a selector is handed its own knobs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

import torch

from infinigen.growing import GrowingTensor
from infinigen.skew.query_map import project_queries
from infinigen.speculate import UNIT_HEADS, Selection, in_units
from infinigen.validation import Validated, at_least, fraction, knob, one_of


@dataclass(frozen=True)
class PolicySpec:
    """What a policy name means. placement: ``compute`` (the whole KV stays with the compute)
    or ``offload`` (it lives in the slow tier); selector: the selector that chooses the rows
    of the speculated layers, or None (every row, every step); fmt: ``native`` or ``int4``;
    default_budget: the fraction of the context it reads when no `budget` is given; summary:
    what it does, in one line; bound: True for an upper bound on quality rather than a system
    (it reads more than it counts in order to choose), whose speed nothing models or plans;
    calibrated: its selector reads a skew artifact calibrated once per model."""

    placement: str
    selector: str | None
    fmt: str = "native"
    default_budget: float = 1.0
    summary: str = ""
    bound: bool = False
    calibrated: bool = False


SELECTING_BUDGET = 0.1  # the budget of every selecting policy unless one is given: 10 % of the context
# The budget of a selection in units of several positions unless one is given: every row read is attended,
# so 20 % in units reads fewer bytes than 10 % row by row from a block tier (docs/results.md, "Units").
UNIT_BUDGET = 0.2


@dataclass(frozen=True)
class SelectionBudget(Validated):
    """How much a selecting policy may fetch: the knobs every selector shares (the oracle's only
    ones), declared once here."""

    budget: float | None = knob(
        None,
        "fraction of the context fetched per step (the one knob): for infinigen the mean over the speculated "
        "layers, spread by `allocation` (and a cap on what passes alpha when alpha is set), for the other "
        f"selecting policies what they keep (default {SELECTING_BUDGET:g})",
        fraction(),
    )
    budget_tokens: int | None = knob(None, "cap on the fetched positions per KV head", at_least(1))


@dataclass(frozen=True)
class UnitSelection(SelectionBudget):
    """The unit a selector chooses in: aligned runs of positions, each KV head's own or shared by
    a token's heads (`speculate.select_blocks`); declared once for the selectors that rank by
    attention (InfiniGen, and the oracle as its bound)."""

    block_tokens: int | None = knob(
        None,
        "select aligned units of this many positions, every row of a chosen unit attended; default: the tier's "
        "read unit (a disk block's positions of one KV head: 16 at d = 64 in 16 bits; one row on the ram and "
        f"pinned tiers); in units the default budget is {UNIT_BUDGET:g} and correction 0 (the correction's "
        "top-up is row by row)",
        at_least(1),
        advanced=True,
    )
    unit_heads: str = knob(
        "own",
        "own: each KV head chooses its units; shared: one choice of positions for all of a token's KV heads "
        "(what a layout keeping a token's heads together reads)",
        one_of(UNIT_HEADS),
        advanced=True,
    )

    @property
    def units(self) -> int:
        """Positions per unit chosen (`block_tokens` unresolved, as when no tier is known: one)."""
        return self.block_tokens or 1


class PrefillWeights(Protocol):
    def column_sums(self) -> torch.Tensor:
        """[B, Hkv, T]: the prefill's attention weights summed over its queries and each GQA group."""


class Selector:
    """Base class of every selector.

    `name` is its policy's name; `Knobs` the dataclass of its settings (`SelectionBudget` or one
    derived from it); `policy` what its policy means (`PolicySpec`, placement ``offload``).
    `query_from` says which query `select` is given, and so when the layer can ask:
      ``"previous"``: layer i's query computed from layer i-1's normalized input — InfiniGen's
                      speculation, asked one layer ahead so that the fetch overlaps layer i-1;
      ``"own"``:      layer i's true query — asked at layer i, so the fetch cannot overlap;
      ``None``:       no query (position or history only) — asked one layer ahead.
    """

    name: ClassVar[str]
    Knobs: ClassVar[type] = SelectionBudget
    policy: ClassVar[PolicySpec]
    query_from: ClassVar[str | None] = None

    def __init__(self, knobs: Any, adapter: Any) -> None:
        """knobs: an instance of `Knobs`; adapter: what the selector may know of the model
        (`num_kv_heads`, `scaling(layer)`)."""
        self.knobs = knobs
        self.adapter = adapter

    def budget(self, layer: int) -> float:
        """The fraction of the context this selector may fetch at `layer` (what `summary()`
        reports next to what it did fetch)."""
        return self.knobs.budget

    def correction(self, layer: int) -> float:
        """The fraction of the context `correct` tops up at `layer` (0: it never does)."""
        return 0.0

    def new_state(self, layer: int) -> Any:
        return None

    def on_append(self, state: Any, layer: int, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """New positions of the layer: keys [B, Hkv, n, d] as computed (post-RoPE); valid [B, n]
        (False at padding). During decode: after the step's `select`, before its attention."""

    def on_prefill(self, state: Any, layer: int, weights: PrefillWeights) -> None:
        """The prefill's attention, computed only if asked for (`weights.column_sums()`)."""

    def query(self, layer: int, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        """The queries `select` is given, from the normalized input x [B, T, D] that `query_from`
        names: [B, H, T, d] post-RoPE, unscaled (the layer's own projection; InfiniGen may use a
        fitted one), in float32 whatever the model's dtype (`project_queries`)."""
        q_proj = self.adapter.attention_modules()[layer].q_proj
        return self.adapter.query_heads(layer, project_queries(q_proj, x), position_embeddings)

    def select(self, state: Any, layer: int, query: torch.Tensor | None, past: int, valid: torch.Tensor) -> Selection:
        """Positions of [0, past) the coming step attends, per (batch, KV head).

        query: [B, H, d] post-RoPE, unscaled (see `query_from`), or None; valid: [B, Hkv, past],
        the positions that exist (real tokens still stored)."""
        raise NotImplementedError

    def correct(
        self, state: Any, layer: int, query: torch.Tensor, past: int, valid: torch.Tensor, selection: Selection
    ) -> Selection | None:
        """Positions of [0, past) to fetch in addition to `selection`, chosen with the layer's own
        query [B, H, d] (post-RoPE, unscaled) once it exists; None (the default): nothing.
        Disjoint from `selection`; what it returns is fetched after the layer's first transfer,
        so its wait is not overlapped."""
        return None

    def observe(
        self, state: Any, layer: int, selection: Selection, probs: torch.Tensor, self_prob: torch.Tensor
    ) -> None:
        """The step's attention weights: probs [B, H, n] on the selection's slots, self_prob
        [B, H] on the current token."""

    @property
    def watches_prefill(self) -> bool:
        """Whether this selector reads the prefill's attention (overrides `on_prefill`): a prefix
        computed elsewhere and replayed into its cache (`prefill.Prefix`) stands in for its
        prefill only with the prompt's attention column sums."""
        return watches_prefill(type(self))

    @property
    def observes(self) -> bool:
        """Whether this selector looks at the attention weights (overrides `observe`): the
        attention skips computing them for those that do not."""
        return type(self).observe is not Selector.observe

    def max_rows(self, layer: int, positions: int) -> int:
        """The most rows one step of `layer` selects among `positions` (its budget, capped by
        `budget_tokens`, floored by `min_tokens`, in whole units): what its transfer buffers must hold."""
        k, fraction = self.knobs, self.budget(layer)
        unit = getattr(k, "units", 1)  # in units: whole units of the budget, the cap and the floor
        cap, floor = in_units(getattr(k, "budget_tokens", None), getattr(k, "min_tokens", 1), unit)
        n = -(-positions // unit)
        count = n if fraction >= 1.0 else math.ceil(fraction * n)
        if cap is not None:
            count = min(count, cap)
        return max(count, floor) * unit

    def state_bytes(self, layer: int, batch: int, positions: int, capacity: int, kv_dtype: torch.dtype) -> int:
        """What its state of `layer` holds with the compute at `positions` for `batch` rows (`capacity`:
        the positions its growing buffers are allocated for); `budget.estimate` plans with it."""
        return 0

    def weight_bytes(self) -> int:
        """Bytes of what it keeps per model, not per cache (calibrated projections, query maps):
        reported apart, with the weights."""
        return 0

    def describe(self) -> dict[str, Any]:
        """The selector and its knobs, JSON-safe."""
        knobs = {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self.knobs).items()}
        return {"policy": self.name, **knobs}


def held_bytes(state: Any) -> int:
    """Bytes a layer's selector state keeps with the compute (partial keys, page bounds,
    accumulated attention), spare capacity included: every state is a small object whose
    attributes are tensors or growing buffers, or such objects in turn. Reported by `summary()`."""
    if state is None:
        return 0
    total = 0
    for v in vars(state).values():
        if isinstance(v, (torch.Tensor, GrowingTensor)):
            total += v.nbytes
        elif hasattr(v, "__dict__") and not callable(v):
            total += held_bytes(v)
    return total


def watches_prefill(cls: type[Selector]) -> bool:
    """Whether selectors of class `cls` read the prefill's attention (override `on_prefill`)."""
    return cls.on_prefill is not Selector.on_prefill
