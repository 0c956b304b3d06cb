"""`infinigen`: speculate layer i's attention from layer i-1's input (partial query of layer i
against the partial keys K̃ᵢ on the skewed channels), keep the positions within α of the top
(within the layer's budget) and fetch only those — one layer ahead, so the fetch overlaps
layer i-1 (Lee et al., OSDI 2024).

Additions, each a knob:
  allocation="calibrated"  the budget is spread over the layers by their oracle recall curves,
                           measured at calibration (`skew.tables.allocate_budgets`); the mean
                           fraction is still `budget` ("uniform": every layer `budget`; the
                           default "auto": whichever of the two calibration measured better on
                           the model, `infinigen.skew.choice`, read before the selector is built);
  channel_allocation="calibrated"  the partial channels are spread over the layers by the
                           recall of speculating with c channels, measured at calibration
                           (`skew.tables.allocate_channels`); the mean count is still r·d;
  speculate_from="fitted"  the speculated query comes from layer i-1's input through layer i's
                           query projection refitted to that input at calibration
                           (`infinigen.skew.query_map`), at the cost of plain speculation;
  correction=c > 0         speculate, then correct: once layer i's own query exists, it scores
                           the partial keys already on the compute side, and the best c·context
                           positions the speculation missed are fetched as a second transfer
                           (`correct`, driven by the layer after its first transfer landed);
  correction=None          the same, chosen per layer from calibration and taken out of the
                           layer's budget (`layer_corrections_from_artifact`): only layers whose
                           speculated output strays from the dense one well beyond the oracle's.

The C kernel implements the threshold/budget/floor rule with one budget per call, so a per-layer
budget uses it too, and the correction's top-up (`kernels.top_up`, the rule of
`speculate.top_up`); blocks (`block_tokens` > 1) too (`speculate.select_blocks` is their tensor path)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import infinigen.kernels as kernels
from infinigen.growing import GrowingTensor
from infinigen.select.base import SELECTING_BUDGET, PolicySpec, Selector, UnitSelection
from infinigen.select.quantized import QuantizedPartialKeys, partial_bytes_per_position
from infinigen.select.unit_moments import UNIT_KEYS, UnitMoments
from infinigen.skew.choice import MeasuredChoice
from infinigen.skew.query_map import apply_query_map, fold_skew_into_map
from infinigen.skew.tables import SPECULATED_INPUTS, allocate_budgets, allocate_channels, correction_share
from infinigen.speculate import (
    UNIT_SCORES,
    Selection,
    aggregate_group,
    expand_units,
    in_units,
    is_all_valid,
    partial_projection,
    partial_scores,
    project_partial,
    select_blocks,
    select_units,
    selection_mask,
    top_up,
    unit_scores,
)
from infinigen.validation import Rule, at_least, fraction, knob, one_of

AGGREGATIONS = ("max", "sum", "union", "mass")
PARTIAL_FORMATS = ("kv", "int8", "int4")  # how the partial keys are kept (infinigen.select.quantized)
ALLOCATIONS = ("auto", "uniform", "calibrated")
CHANNEL_ALLOCATIONS = ("uniform", "calibrated")
SPECULATION_INPUTS = ("previous", "fitted", "own")

_ALPHA = Rule(">= 0 (inf keeps everything)", lambda v: v >= 0)
_LAYER_ALPHA = Rule(
    "a map {layer: alpha} of integers to numbers >= 0",
    lambda d: all(v >= 0 for v in d.values()),
)


@dataclass(frozen=True)
class SpeculationKnobs(UnitSelection):
    """InfiniGen's selector: skewed partial query of layer i from layer i-1's input (through
    layer i's query projection refitted to that input at calibration) against the partial keys;
    each layer keeps the top of its budget (`budget`, or a calibrated spread of it), an optional
    threshold alpha, and a floor. Defaults chosen on the essays, on every model measured, and
    reported on other genres (docs/results.md, "Quality on SmolLM2-135M"; docs/CHANGELOG.md): every
    knob but the budget is a research switch."""

    alpha: float = knob(
        math.inf,
        "keep only positions whose speculated score is within alpha of the top (default inf: the budget decides; "
        "the paper's threshold, e.g. 5, allocates worse on unseen text)",
        _ALPHA,
        advanced=True,
    )
    partial_ratio: float = knob(
        0.625, "fraction r of the head dimension kept as partial channels", fraction(), advanced=True
    )
    partial_format: str = knob(
        "int4",
        "how the partial keys are kept with the compute: kv (the KV's storage dtype), int8 or int4 (codes about "
        "a mean per channel, with a scale per channel and per position: about a half or a quarter of 16-bit, "
        "scored without widening)",
        one_of(PARTIAL_FORMATS),
        advanced=True,
    )
    aggregation: str = knob(
        "mass",
        "how a GQA group's query heads make one selection per KV head: union, max, sum or mass",
        one_of(AGGREGATIONS),
        advanced=True,
    )
    skew: bool = knob(True, "apply the SVD skew before choosing channels (off: plain channel choice)", advanced=True)
    calibration_tokens: int | None = knob(
        None, "calibration length (default: the model's context, at most 8192)", at_least(16), advanced=True
    )
    min_tokens: int = knob(8, "floor on the fetched positions per KV head", at_least(1), advanced=True)
    unit_keys: str = knob(
        "positions",
        "with block_tokens > 1: what the speculation scores: every position's partial key (positions), or each "
        "unit's mean partial key (mean) or its mean and per-channel variance (moments), a unit's estimated mass "
        "from T / block_tokens summaries (`infinigen.select.unit_moments`); the partial keys stay for the "
        "correction",
        one_of(UNIT_KEYS),
        advanced=True,
    )
    unit_score: str = knob(
        "mass",
        "with block_tokens > 1: how a unit is scored from its positions' speculated scores: max (its best), "
        "mass (its summed estimated attention) or top2 (the mean of its two best)",
        one_of(UNIT_SCORES),
        advanced=True,
    )
    layer_alpha: dict[int, float] = knob({}, "per-layer alpha overrides, e.g. 2:6,25:6", _LAYER_ALPHA, advanced=True)
    allocation: str = knob(
        "auto",
        "how the budget is spread over the speculated layers: uniform (the same fraction each, as the oracle it "
        "is measured against), calibrated (per-layer fractions with the same mean, from the oracle recall curves "
        "in the skew artifact) or auto (whichever of the two loses less against the oracle on held-out text, "
        "measured once per model at calibration and stored in the skew artifact; `infinigen.skew.choice`)",
        one_of(ALLOCATIONS),
        advanced=True,
    )
    channel_allocation: str = knob(
        "uniform",
        "how partial channels are spread over the speculated layers: uniform (round(partial_ratio x head_dim) "
        "each) or calibrated (per-layer counts with that mean, from the partial-score recall measured at "
        "calibration and stored in the skew artifact)",
        one_of(CHANNEL_ALLOCATIONS),
        advanced=True,
    )
    correction: float | None = knob(
        None,
        "speculate, then correct: at layer i its own query scores the partial keys, and a fraction of the "
        "context that the speculation missed is fetched as a second, small transfer. A number: that fraction, "
        "on top of the budget, in every speculated layer (0: off). none: chosen per layer from calibration, "
        "out of the layer's budget: only where the speculation's attention output strays more than "
        "correction_target times the oracle's, the least top-up that brings it within",
        fraction(low_open=False),
        advanced=True,
    )
    correction_target: float | None = knob(
        None,
        "with correction none: the multiple of the oracle's attention-output error (measured per layer at "
        "calibration) above which a layer's speculation is corrected. Default: chosen per model with the spread, "
        "by measurement on held-out text at calibration: the largest of the targets tried "
        "(`skew.choice.CORRECTION_TARGETS`) whose KL from dense is within `KL_AIM` times the oracle's, else the one "
        "of least KL",
        at_least(1),
        advanced=True,
    )
    speculate_from: str = knob(
        "fitted",
        "the input the speculated query is formed from: previous (layer i-1's, one layer ahead, overlapped), "
        "fitted (layer i-1's, through layer i's query projection refitted to it at calibration; as fast as "
        "previous) or own (layer i's, not overlapped: measures what speculating from the previous layer costs)",
        one_of(SPECULATION_INPUTS),
        advanced=True,
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


@dataclass
class WithUnits:
    """The partial keys (for the correction) and the units' moments the speculation scores."""

    partial: PartialKeys | QuantizedPartialKeys
    units: UnitMoments


def _partial(state) -> PartialKeys | QuantizedPartialKeys:
    return state.partial if isinstance(state, WithUnits) else state


class InfiniGenSelector(Selector):
    name = "infinigen"
    Knobs = SpeculationKnobs
    policy = PolicySpec(
        "offload",
        "infinigen",
        default_budget=SELECTING_BUDGET,
        summary="speculated one layer ahead from partial keys; the top of each layer's budget",
        calibrated=True,
    )

    def __init__(
        self,
        knobs: SpeculationKnobs,
        adapter,
        projections: dict[int, torch.Tensor],
        layer_budgets: dict[int, float] | None = None,
        speculated: list[int] | range | None = None,
        query_maps: dict[int, torch.Tensor] | None = None,
        kv_dtype: torch.dtype | None = None,
        layer_corrections: dict[int, float] | None = None,
        measured: MeasuredChoice | None = None,
    ) -> None:
        """projections: per layer, the skew columns of the partial channels [Hkv, d, c]
        (see `projections_from_artifact`; c may differ between layers); layer_budgets: per
        speculated layer, its fraction (allocation "calibrated"; `skew.tables.allocate_budgets`),
        else `budget` everywhere; speculated: the layers whose channel counts `describe` reports;
        query_maps: per layer, its fitted query map [D + 1, H·d] (`query_maps_from_artifact`);
        kv_dtype: the KV's storage dtype, which the partial keys are kept in too (None: the
        compute dtype). They stay with the compute for the whole context: with 16-bit KV they
        take r of the stored keys' bytes, where float32 copies took 2r. layer_corrections: per
        speculated layer, the fraction of the context its top-up fetches
        (`layer_corrections_from_artifact`), else `correction` everywhere. measured: the
        calibration's choice that "auto" and the unset target read, which `describe` reports."""
        super().__init__(knobs, adapter)
        self.measured = measured
        self.layer_corrections = dict(layer_corrections or {})
        self.proj = projections
        self.layer_budgets = dict(layer_budgets or {})
        self.speculated = speculated if speculated is not None else range(0)
        self.query_maps = dict(query_maps or {})
        self.kv_dtype = kv_dtype

    def channels(self, layer: int) -> int:
        """The number of partial channels this layer speculates with."""
        return int(self.proj[layer].shape[-1])

    @property
    def query_from(self) -> str:  # type: ignore[override]
        """ "previous" (the method: one layer ahead; also for "fitted", which maps the same
        input differently), or "own" when measuring without the previous layer's error
        (`speculate_from`)."""
        return "own" if self.knobs.speculate_from == "own" else "previous"

    def query(self, layer: int, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        """The speculated queries: through the layer's fitted query map if it has one
        (`speculate_from` "fitted"), else through its own projection."""
        m = self.query_maps.get(layer)
        if m is None:
            return super().query(layer, x, position_embeddings)
        return self.adapter.query_heads(layer, apply_query_map(x, m), position_embeddings)

    def alpha(self, layer: int) -> float:
        return float(self.knobs.layer_alpha.get(layer, self.knobs.alpha))

    def budget(self, layer: int) -> float:
        """This layer's fraction of the context: its calibrated share, or the budget (with a
        calibrated correction, its top-up included)."""
        return self.layer_budgets.get(layer, self.knobs.budget)

    def correction(self, layer: int) -> float:
        """This layer's top-up as a fraction of the context: its calibrated one (out of its
        budget), or `correction` (on top of it)."""
        return self.layer_corrections.get(layer, self.knobs.correction or 0.0)

    def speculated_budget(self, layer: int) -> float:
        """The fraction the speculation picks: the layer's budget less a calibrated top-up."""
        return self.budget(layer) - self.layer_corrections.get(layer, 0.0)

    def new_state(self, layer: int) -> PartialKeys | QuantizedPartialKeys | WithUnits:
        fmt = self.knobs.partial_format
        partial = PartialKeys() if fmt == "kv" else QuantizedPartialKeys(fmt)
        if self.knobs.unit_keys == "positions":
            return partial
        return WithUnits(partial, UnitMoments(self.knobs.units))

    def on_append(self, state, layer, keys, valid) -> None:
        kp = project_partial(keys, self.proj[layer])
        if isinstance(state, WithUnits):
            state.units.append(kp, valid)
            state = state.partial
        if isinstance(state, QuantizedPartialKeys):
            state.append(kp, valid)
        else:
            state.buffer.append(kp.to(self.kv_dtype or keys.dtype).transpose(-1, -2))

    def scores(self, state, layer: int, query: torch.Tensor, past: int, valid) -> torch.Tensor:
        """Speculated group scores [B, Hkv, past] (-inf where not valid)."""
        state = _partial(state)
        if isinstance(state, QuantizedPartialKeys):  # as the kernel scores codes (4-bit: in integers)
            s = state.scores(self._scaled_partial_query(layer, query), past)
        else:
            q_part = project_partial(query[:, :, None], self.proj[layer])[:, :, 0]
            s = partial_scores(q_part, state.keys[:, :, :past], self.adapter.scaling(layer))
        return aggregate_group(s, valid, self.adapter.num_kv_heads, self.knobs.aggregation)

    def select(self, state, layer, query, past, valid) -> Selection:
        k = self.knobs
        budget = self.speculated_budget(layer)
        shared = k.unit_heads == "shared"
        if isinstance(state, WithUnits):
            return self._select_by_unit_keys(state.units, layer, query, past, valid, budget)
        if not shared and self._kernel_reads(state, query):
            # One call instead of a dozen tensor operations: the same rule (see infinigen.kernels).
            keys, q, scales, bias = self._kernel_operands(state, layer, query)
            idx, counts = kernels.select(
                keys, past, q, None if is_all_valid(valid) else valid, k.aggregation, self.alpha(layer),
                budget, k.budget_tokens, k.min_tokens, scales=scales, block=k.units, bias=bias,
                unit_score=k.unit_score,
            )  # fmt: skip
            return _selection(idx, counts)
        g = self.scores(state, layer, query, past, valid)
        return select_blocks(
            g, valid, k.units, self.alpha(layer), budget, k.budget_tokens, k.min_tokens, k.unit_score, shared
        )

    def _select_by_unit_keys(self, units: UnitMoments, layer, query, past, valid, budget) -> Selection:
        """Units ranked by their estimated mass from their moments (`unit_keys`), the group's
        query heads aggregated as for positions, every valid row of a chosen unit selected. The
        kernel scores and ranks the units' summaries as it does positions' keys; shared units
        take the tensor path."""
        k = self.knobs
        block, hkv = k.units, self.adapter.num_kv_heads
        q_part = project_partial(query[:, :, None], self.proj[layer])[:, :, 0]
        n_units, held = units.units_held(past)
        ok = held[:, None, :].expand(held.shape[0], hkv, n_units)
        if k.unit_heads != "shared" and self._kernel_takes(units.summary.full, query):
            q = units.query(q_part, self.adapter.scaling(layer), k.unit_keys)
            chosen, counts = kernels.select(
                units.summary.full, n_units, q, None if bool(held.all()) else ok, k.aggregation,
                self.alpha(layer), budget, *in_units(k.budget_tokens, k.min_tokens, block),
            )  # fmt: skip
            slots = torch.arange(chosen.shape[-1]) < counts[..., None]
            return expand_units(chosen, slots, valid, block)
        s, _ = units.scores(q_part, self.adapter.scaling(layer), k.unit_keys)
        g = aggregate_group(s[..., :n_units], ok, hkv, k.aggregation)
        if k.unit_heads == "shared":  # one choice for a token's heads: the heads' masses summed, as for positions
            g, ok = unit_scores(g, ok, 1, "mass", shared=True)
        return select_units(g, ok, valid, block, self.alpha(layer), budget, k.budget_tokens, k.min_tokens)

    @staticmethod
    def _kernel_takes(keys: torch.Tensor, query: torch.Tensor, codes: bool = False) -> bool:
        """Whether the selection kernel can score these keys (float, or quantized `codes`) for
        this query (else the tensor path does)."""
        return (
            (codes or keys.dtype in kernels.KEY_FORMATS)
            and keys.device.type == "cpu"
            and query.shape[1] // keys.shape[1] <= kernels.MAX_GROUP
            and kernels.available()
        )

    def _kernel_reads(self, state, query: torch.Tensor) -> bool:
        """Whether the C kernels can score these partial keys (else the tensor path does)."""
        state = _partial(state)
        quantized = isinstance(state, QuantizedPartialKeys)
        return self._kernel_takes(state.codes.full if quantized else state.buffer.full, query, quantized)

    def _kernel_operands(self, state, layer: int, query: torch.Tensor):
        """(keys, scaled partial query, scales or None, bias or None) as the kernels take them."""
        state = _partial(state)
        q = self._scaled_partial_query(layer, query)
        if isinstance(state, QuantizedPartialKeys):
            return state.codes.full, state.kernel_query(q), state.scales.full, state.kernel_bias(q)
        return state.buffer.full, q, None, None

    def _scaled_partial_query(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        q_part = project_partial(query[:, :, None], self.proj[layer])[:, :, 0]
        return q_part.to(torch.float32) * self.adapter.scaling(layer)

    def state_bytes(self, layer: int, batch: int, positions: int, capacity: int, kv_dtype: torch.dtype) -> int:
        c, fmt = self.channels(layer), self.knobs.partial_format
        itemsize = torch.empty((), dtype=self.kv_dtype or kv_dtype).element_size()
        per_row = capacity * partial_bytes_per_position(fmt, c, itemsize) + (0 if fmt == "kv" else 8 * c)  # + mu, sigma
        units = 0
        if self.knobs.unit_keys != "positions":
            n = -(-capacity // self.knobs.units)
            units = batch * n * UnitMoments.bytes_per_unit(self.adapter.num_kv_heads, c)
        return batch * self.adapter.num_kv_heads * per_row + units

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in (*self.proj.values(), *self.query_maps.values()))

    def describe(self) -> dict:
        out = super().describe()
        if self.measured is not None:
            out["chosen_by_calibration"] = self.measured.describe()
        if self.layer_budgets:
            out["layer_budgets"] = {str(i): round(b, 5) for i, b in sorted(self.layer_budgets.items())}
        if self.layer_corrections:
            out["layer_corrections"] = {str(i): round(c, 5) for i, c in sorted(self.layer_corrections.items())}
        layers = [i for i in self.speculated if i in self.proj]
        if layers:
            out["layer_channels"] = {str(i): self.channels(i) for i in layers}
        return out

    def correct(self, state, layer, query, past, valid, selection: Selection) -> Selection | None:
        """The top-up: layer i's own query against the partial keys; the ceil(correction ·
        context) best positions the speculated `selection` does not hold."""
        fraction = self.correction(layer)
        if fraction <= 0 or past == 0:
            return None
        all_valid = is_all_valid(valid)
        ctx = torch.full(valid.shape[:2], past, device=valid.device) if all_valid else valid.sum(-1)
        count = torch.ceil(ctx.to(torch.float64) * fraction).to(torch.long)
        chosen = selection_mask(selection, past)
        if self._kernel_reads(state, query):
            keys, q, scales, bias = self._kernel_operands(state, layer, query)
            idx, counts = kernels.top_up(
                keys, past, q, None if all_valid else valid, self.knobs.aggregation, chosen, count,
                scales=scales, bias=bias,
            )  # fmt: skip
            return _selection(idx, counts)
        return top_up(self.scores(state, layer, query, past, valid), valid, chosen, count)


def _selection(idx: torch.Tensor, counts: torch.Tensor) -> Selection:
    """A kernel's (indices, counts) as a Selection (slots past a row's count are padding)."""
    return Selection(idx, torch.arange(idx.shape[-1], device=idx.device) < counts[..., None])


def layer_budgets_from_artifact(artifact, knobs: SpeculationKnobs, layers: list[int]) -> dict[int, float]:
    """Per speculated layer, its fraction of the context under `knobs.allocation`: empty for
    "uniform" (every layer takes `budget`), else the calibrated spread of `budget`."""
    if knobs.allocation != "calibrated" or knobs.budget >= 1.0:
        return {}
    if not artifact.recall_curves or artifact.recall_grid is None:
        raise ValueError("allocation 'calibrated' needs a skew artifact with recall curves: recalibrate it")
    return allocate_budgets({i: artifact.recall_curves[i] for i in layers}, artifact.recall_grid, knobs.budget)


def layer_corrections_from_artifact(
    artifact, knobs: SpeculationKnobs, layers: list[int], budgets: dict[int, float]
) -> dict[int, float]:
    """Per speculated layer whose speculation is corrected under `correction` None, its top-up
    as a fraction of the context: the share `skew.tables.correction_share` chooses from the
    layer's calibrated table (for the input `speculate_from` names) of its budget (`budgets`,
    else `budget`), which the speculation then picks less of. Empty for a number (`correction`
    everywhere, on top of the budget) and for speculate_from "own" (the speculation is the
    layer's own query: nothing to correct)."""
    if knobs.correction is not None or knobs.speculate_from == "own" or not len(layers):
        return {}
    if not artifact.has_correction_tables():
        raise ValueError(
            "correction none (chosen per layer) needs a skew artifact with correction tables: recalibrate it"
        )
    grid = (tuple(artifact.correction_budgets.tolist()), tuple(artifact.correction_shares.tolist()))
    source = SPECULATED_INPUTS.index("fitted" if knobs.speculate_from == "fitted" else "previous")
    out = {}
    for i in layers:
        table = artifact.correction_errors.get(i)
        if table is None:
            continue
        budget = budgets.get(i, knobs.budget)
        share = correction_share(table[source], artifact.oracle_errors[i], budget, *grid, knobs.correction_target)
        if share > 0:
            out[i] = budget * share
    return out


def layer_channels_from_artifact(artifact, knobs: SpeculationKnobs, layers: list[int], head_dim: int) -> dict[int, int]:
    """Per speculated layer, its channel count under `knobs.channel_allocation`: empty for
    "uniform" (every layer keeps the artifact's round(r·d) channels), else the calibrated
    spread of r·d (`skew.tables.allocate_channels`)."""
    if knobs.channel_allocation != "calibrated" or not len(layers):
        return {}
    if not artifact.has_channel_recall():
        raise ValueError(
            "channel_allocation 'calibrated' needs a skew artifact with channel recall tables: recalibrate it"
        )
    grid = artifact.channel_grid.tolist()
    tables = {i: artifact.channel_recall[i] for i in layers}
    return allocate_channels(tables, grid, artifact.partial_ratio, head_dim)


def channels_from_artifact(artifact, counts: dict[int, int]) -> dict[int, torch.Tensor]:
    """Per layer, its partial channels [Hkv, c]: the top counts[i] of the layer's ranked
    channels where `counts` names the layer, else the artifact's (uniform) channels."""
    out = dict(artifact.channels)
    for i, c in counts.items():
        out[i] = artifact.channel_orders[i][:, :c].sort(-1).values.to(torch.long)
    return out


def projections_from_artifact(
    artifact, head_dim: int, folded: bool, device, channels: dict[int, torch.Tensor] | None = None
) -> dict[int, torch.Tensor]:
    """Per layer, the projection onto the skewed partial channels, on `device` (one device, or
    {layer: device} for a model split across devices). For a model whose skew is folded into its
    weights (no RoPE: OPT), keys arrive already skewed: channels only. `channels`: per layer,
    the channels to use instead of the artifact's (`channels_from_artifact`)."""
    out = {}
    for i, chosen in (channels if channels is not None else artifact.channels).items():
        a = None if folded else artifact.skews.get(i)
        where = device.get(i, "cpu") if isinstance(device, dict) else device
        out[i] = partial_projection(a, chosen, head_dim).to(where)
    return out


def query_maps_from_artifact(
    artifact, knobs: SpeculationKnobs, layers: list[int], num_heads: int, folded: bool, device
) -> dict[int, torch.Tensor]:
    """Per speculated layer, its fitted query map (float32, on the layer's `device`: one, or
    {layer: device}) for `speculate_from` "fitted", else empty. For a model whose skew is folded
    into W_q, the skew is folded into the map as well."""
    if knobs.speculate_from != "fitted":
        return {}
    if not artifact.has_query_maps():
        raise ValueError("speculate_from 'fitted' needs a skew artifact with query maps: recalibrate it")
    out = {}
    for i in layers:
        m = artifact.query_maps[i].to(torch.float32)
        if folded and artifact.skews.get(i) is not None:
            m = fold_skew_into_map(m, artifact.skews[i], num_heads)
        out[i] = m.to(device.get(i, "cpu") if isinstance(device, dict) else device)
    return out
