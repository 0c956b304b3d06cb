"""The settings of InfiniGen's selector that are chosen per model by measurement: the budget's
spread over the speculated layers (`allocation="auto"`, the default) and the correction target
(`correction_target` left unset, the default).

Neither spread is best on every model: the calibrated one (per-layer fractions from the oracle's
recall curves) is the better on SmolLM2-135M, the uniform one on Gemma-3-270m, and the per-layer
tables that calibration keeps do not predict which (docs/results.md, "The budget spread"). Nor
does the per-layer output error that decides which layers the correction tops up predict the end
loss on every model: on Gemma-3-270m it understates it. So both are chosen as they were found, by
the end-to-end loss: on held-out text (the opening of the calibration essay, whose end the
calibration reads, and standard-library Python that neither the calibration nor the `code`
evaluation genre reads), each candidate is teacher-forced through the model at the settings
asked for, against dense and the oracle at the same budget:

1. the spread whose KL from dense is the smaller multiple of the oracle's is kept (the uniform one
   on a tie), at the least correction (`speculate.CORRECTION_TARGETS[0]`, or the target given);
2. then, where the target is left to the measurement, the first of `CORRECTION_TARGETS` (least
   correction first) whose KL is within `KL_AIM` times the oracle's, else the one of least KL.
   Stricter targets are run only where the first misses the aim, so a model that needs no more
   correction pays nothing for it.

The choice is stored in the skew artifact's metadata, under a key of the settings it depends on,
so that it is measured once per model and settings, never reused for others. `resolve_measured`
turns "auto" and the unset target into the stored choice; `infinigen.eval.spread_choice.measure`
makes it (run by the attach session, which owns the model while it is measured).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace

from infinigen.config import ALLOCATIONS, InfiniGenConfig, SpeculationKnobs
from infinigen.speculate import CORRECTION_TARGETS, KL_AIM

SPREADS = tuple(a for a in ALLOCATIONS if a != "auto")  # the candidates, uniform first (it wins ties)
TARGETS = CORRECTION_TARGETS  # the correction targets, least correction first
_META_PREFIX = "spread:"
# The artifact-level settings: the artifact is already keyed by them; every other speculation
# setting can change the choice (an explicit spread included: its target is measured apart).
_NOT_IN_KEY = {"partial_ratio", "skew", "calibration_tokens"}


@dataclass(frozen=True)
class SpreadChoice:
    """What was kept, and what each candidate measured: KL from dense as a multiple of the
    oracle's (mean over the held-out windows), on `windows` windows of `context` tokens, `scored`
    each. kl_ratio: per spread (at the least correction); correction_target: the target chosen
    (None where the configuration gave one); target_kl_ratio: per target run (its `:g` text),
    with the chosen spread."""

    choice: str
    kl_ratio: dict[str, float]
    context: int
    scored: int
    windows: int
    correction_target: float | None = None
    target_kl_ratio: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SpreadChoice:
        choice = cls(**json.loads(text))
        if choice.choice not in SPREADS:
            raise ValueError(f"unknown spread {choice.choice!r}")
        if choice.correction_target is not None and not choice.correction_target >= 1:
            raise ValueError(f"correction target {choice.correction_target!r} below 1")
        return choice


def settings_key(config: InfiniGenConfig) -> str:
    """The metadata key of the choice for `config`'s settings: a digest of every speculation
    setting but the artifact's own, of the budget as resolved, and of the dense layers. Not of
    the storage dtype: it rounds the KV, it does not move which positions matter."""
    knobs = config.knobs(SpeculationKnobs)
    settings = {f.name: getattr(knobs, f.name) for f in fields(knobs) if f.name not in _NOT_IN_KEY}
    settings["layer_alpha"] = {str(k): v for k, v in sorted(settings["layer_alpha"].items())}
    settings["alpha"] = repr(float(settings["alpha"]))
    settings["dense_layers"] = config.dense_layers
    text = json.dumps(settings, sort_keys=True, default=repr)
    return _META_PREFIX + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def stored_choice(artifact, config: InfiniGenConfig) -> SpreadChoice | None:
    """The choice the artifact holds for `config`'s settings (None: not measured yet)."""
    text = artifact.meta.get(settings_key(config))
    if text is None:
        return None
    try:
        return SpreadChoice.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None  # unreadable: measured again


def target_left(config: InfiniGenConfig) -> bool:
    """Whether `config` leaves the correction target to the measurement: unset, with the
    correction chosen per layer (`correction` None) from a speculation that has one to correct."""
    return config.correction is None and config.correction_target is None and config.speculate_from != "own"


def needs_measuring(config: InfiniGenConfig) -> bool:
    """Whether `config` leaves a setting to the measurement: allocation "auto" or the correction
    target (`target_left`), with a budget below the whole context (at the whole context every
    spread and target keeps everything)."""
    return (
        config.policy == "infinigen"
        and config.resolved_budget < 1.0
        and (config.allocation == "auto" or target_left(config))
    )


def resolve_measured(knobs: SpeculationKnobs, artifact, config: InfiniGenConfig) -> SpeculationKnobs:
    """`knobs` with allocation "auto" and the unset correction target replaced by what is stored
    for `config`'s settings (uniform and the least correction where nothing needs measuring).
    Raises if it has not been measured."""
    if knobs.allocation != "auto" and knobs.correction_target is not None:
        return knobs
    spread, target = SPREADS[0], TARGETS[0]  # what nothing to measure leaves
    if needs_measuring(config):
        choice = stored_choice(artifact, config)
        if choice is None:
            raise ValueError(
                "the budget's spread (allocation 'auto') and the correction target (left unset) are chosen by a "
                "measurement on the model that has not been made for these settings: attach the model "
                f"(`infinigen.attach`), whose session measures it, or set allocation to one of "
                f"{', '.join(SPREADS)} and correction_target to a number"
            )
        spread = choice.choice
        target = choice.correction_target if choice.correction_target is not None else target
    return replace(
        knobs,
        allocation=spread if knobs.allocation == "auto" else knobs.allocation,
        correction_target=target if knobs.correction_target is None else knobs.correction_target,
    )


def choose_target(ratios: dict[float, float]) -> float:
    """The first of `TARGETS` measured in `ratios` (target -> KL as a multiple of the oracle's)
    within `KL_AIM`, else the one of least KL (the least correction of equals)."""
    measured = [t for t in TARGETS if t in ratios]
    within = [t for t in measured if ratios[t] <= KL_AIM]
    if within:
        return within[0]
    return min(measured, key=lambda t: (ratios[t] if not math.isnan(ratios[t]) else math.inf, measured.index(t)))
