"""Selectors: InfiniGen and the selecting baselines it is measured against, one file each, one
signature (`Selector.select(state, layer, query, past, valid) -> Selection`).

`SELECTORS` is the registry: each selector's file declares the selector, its settings (`Knobs`)
and what its policy means (`policy`), and `infinigen.config` builds `InfiniGenConfig` and
`POLICIES` from this registry. The arrow points from the config to here: nothing in this package
imports the config; the functions below take any object with the config's attributes.

`dense`, `full` and `int4` are not selectors: they are placements and storage formats, declared in
`infinigen.config`, so a policy without a selector reads every row.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import torch

from infinigen.roles import Role
from infinigen.select.base import SELECTING_BUDGET, UNIT_BUDGET, PolicySpec, SelectionBudget, Selector
from infinigen.select.h2o import H2OSelector
from infinigen.select.infinigen import (
    InfiniGenSelector,
    SpeculationKnobs,
    channels_from_artifact,
    layer_budgets_from_artifact,
    layer_channels_from_artifact,
    layer_corrections_from_artifact,
    projections_from_artifact,
    query_maps_from_artifact,
)
from infinigen.select.oracle import OracleSelector
from infinigen.select.quest import QuestSelector
from infinigen.select.streaming import StreamingSelector
from infinigen.skew.choice import CORRECTION_TARGETS, SPREADS, MeasuredChoice, stored_choice


def _registry(*classes: type[Selector]) -> dict[str, type[Selector]]:
    """`classes` by their policy's name, each checked when the package is imported: its policy
    offloads the KV and names it as its selector."""
    for cls in classes:
        if cls.policy.selector != cls.name or cls.policy.placement != "offload":
            raise TypeError(f"selector {cls.name!r}: its policy must be an offloading one that names it")
    return {cls.name: cls for cls in classes}


# The registry: a new selector is one more class here. In this order the selectors' knobs become
# the config's fields, and so the order of the command line's flags.
SELECTORS = _registry(InfiniGenSelector, H2OSelector, StreamingSelector, QuestSelector, OracleSelector)


class Settings(Protocol):
    """What the functions below read of a configuration: `infinigen.config.InfiniGenConfig` is
    one (this package does not import it: the config is built from this package's registry)."""

    policy: str
    spec: PolicySpec
    resolved_budget: float
    allocation: str
    correction: float | None
    correction_target: float | None
    speculate_from: str

    def knobs(self, cls: type) -> Any: ...

    def layer_roles(self, adapter) -> list[Role]: ...

    def storage_dtype(self) -> torch.dtype | None: ...


def make_selector(config: Settings, adapter, artifact=None, folded: bool = False) -> Selector | None:
    """The selector of `config.policy` (None for a policy that reads every row), in the unit
    `config` names (the config makes a unit left to the tier concrete: `in_read_units`; unset
    here, it is one position). InfiniGen's needs the skew artifact (`folded`: the skew is
    already in the model's weights)."""
    name = config.spec.selector
    if name is None:
        return None
    cls = SELECTORS[name]
    knobs = config.knobs(cls.Knobs)
    if cls is InfiniGenSelector:
        if artifact is None:
            raise ValueError("the infinigen selector needs the skew artifact of an attach session")
        measured = measured_choice(artifact) if reads_choice(config) else None
        knobs = resolve_measured(knobs, artifact, config)
        selecting = selecting_layers(config, adapter)
        counts = layer_channels_from_artifact(artifact, knobs, selecting, adapter.head_dim)
        channels = channels_from_artifact(artifact, counts)
        devices = layer_devices(adapter)
        projections = projections_from_artifact(artifact, adapter.head_dim, folded, devices, channels)
        budgets, corrections = _budgets_and_corrections(artifact, knobs, selecting)
        maps = query_maps_from_artifact(artifact, knobs, selecting, adapter.num_heads, folded, devices)
        return InfiniGenSelector(
            knobs, adapter, projections, budgets, selecting, maps, config.storage_dtype(), corrections,
            measured,
        )  # fmt: skip
    if cls is OracleSelector:
        return OracleSelector(knobs, adapter, kv_dtype=config.storage_dtype())
    return cls(knobs, adapter)


class NotCalibratedError(ValueError):
    """The artifact lacks the calibration's measured choice that a setting left to it reads."""


def measured_choice(artifact) -> MeasuredChoice | None:
    """The calibration's choice stored in `artifact`, if it was measured at today's reference
    settings (`calibration.reference_config`: every setting but the artifact's own at its default,
    the partial keys' format included); None otherwise, and calibration measures it again."""
    return stored_choice(artifact, partial_format=SpeculationKnobs.partial_format)


def reads_choice(config: Settings) -> bool:
    """Whether `config` reads the calibration's measured choice: InfiniGen below the whole context
    with the spread left to it ("auto"), or the correction target left to it (unset, with the
    correction chosen per layer from a speculation that has something to correct)."""
    return (
        config.spec.selector == InfiniGenSelector.name
        and config.resolved_budget < 1.0
        and (config.allocation == "auto" or _target_left(config))
    )


def _target_left(knobs) -> bool:
    return knobs.correction_target is None and knobs.correction is None and knobs.speculate_from != "own"


def resolve_measured(knobs, artifact, config: Settings):
    """`knobs` with allocation "auto" and the unset correction target replaced by the values the
    calibration measured and stored in `artifact` (`infinigen.skew.choice`) where `config` reads
    them (`reads_choice`), else by the uniform spread and the least correction."""
    spread, target = SPREADS[0], CORRECTION_TARGETS[0]
    if reads_choice(config):
        choice = measured_choice(artifact)
        if choice is None:
            raise NotCalibratedError(
                "this skew artifact holds no budget spread and correction target (allocation 'auto', "
                "correction_target unset) measured at today's reference settings: calibrate it with `infinigen skew`, "
                "or attach with `infinigen.attach`, "
                f"which calibrates on first use; or set allocation to one of {', '.join(SPREADS)} and "
                "correction_target to a number"
            )
        spread, target = choice.allocation, choice.correction_target
    return replace(
        knobs,
        allocation=spread if knobs.allocation == "auto" else knobs.allocation,
        correction_target=target if knobs.correction_target is None else knobs.correction_target,
    )


def selecting_layers(config: Settings, adapter) -> list[int]:
    """The layers whose rows the selector chooses (not dense, not sliding-window ones): the
    budget's and the channel count's means are over these."""
    return [i for i, role in enumerate(config.layer_roles(adapter)) if role == Role.SELECT]


def corrections_chosen(config: Settings, adapter, artifact) -> dict[int, float]:
    """Per layer, the top-up `config` (policy infinigen) fetches with this artifact, as a fraction
    of the context: the calibrated choice for `correction` None, else the number everywhere."""
    knobs = config.knobs(InfiniGenSelector.Knobs)
    layers = selecting_layers(config, adapter)
    if knobs.correction is not None:
        return {i: knobs.correction for i in layers if knobs.correction > 0}
    knobs = resolve_measured(knobs, artifact, config)
    return _budgets_and_corrections(artifact, knobs, layers)[1]


def _budgets_and_corrections(artifact, knobs, layers: list[int]) -> tuple[dict[int, float], dict[int, float]]:
    """Per layer, its budget and its calibrated top-up (each empty where the knobs choose none):
    the one derivation `make_selector` builds with and `corrections_chosen` reports."""
    budgets = layer_budgets_from_artifact(artifact, knobs, layers)
    return budgets, layer_corrections_from_artifact(artifact, knobs, layers, budgets)


def layer_devices(adapter) -> dict[int, torch.device]:
    """Where each layer's attention computes: its weights' device (a model split across devices
    by a `device_map` has several), so that a layer's selector state lives next to it."""
    default = next(adapter.model.parameters()).device
    out = {}
    for i, attn in enumerate(adapter.attention_modules()):
        weight = next(attn.parameters(), None)
        out[i] = weight.device if weight is not None and weight.device.type != "meta" else default
    return out


__all__ = [
    "SELECTING_BUDGET",
    "UNIT_BUDGET",
    "SELECTORS",
    "NotCalibratedError",
    "PolicySpec",
    "SelectionBudget",
    "Selector",
    "Settings",
    "corrections_chosen",
    "make_selector",
    "reads_choice",
    "resolve_measured",
    "selecting_layers",
]
