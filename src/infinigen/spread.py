"""The budget's spread over the speculated layers, chosen per model by measurement
(`allocation="auto"`, the default).

Neither spread is best on every model: the calibrated one (per-layer fractions from the oracle's
recall curves) is the better on SmolLM2-135M, the uniform one on Gemma-3-270m, and the per-layer
tables that calibration keeps do not predict which (docs/results.md, "The budget spread"). So the
choice is made as it was found, by the end-to-end loss: on held-out text (the opening of the
calibration essay, whose end the calibration reads, and standard-library Python that neither the
calibration nor the `code` evaluation genre reads), each spread is teacher-forced through the
model at the settings asked for, and the one whose KL from dense is the smaller multiple of the
oracle's at the same budget is kept (the uniform one on a tie).

The choice is stored in the skew artifact's metadata, under a key of the settings it depends on,
so that it is measured once per model and settings, never reused for others. `resolve_allocation` turns
"auto" into the stored choice; `infinigen.eval.spread_choice.measure` makes it (run by the attach
session, which owns the model while it is measured).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace

from infinigen.config import ALLOCATIONS, InfiniGenConfig, SpeculationKnobs

SPREADS = tuple(a for a in ALLOCATIONS if a != "auto")  # the candidates, uniform first (it wins ties)
_META_PREFIX = "spread:"
# The artifact-level settings: the artifact is already keyed by them, and `allocation` is the
# choice itself; every other speculation setting can change which spread is better.
_NOT_IN_KEY = {"allocation", "partial_ratio", "skew", "calibration_tokens"}


@dataclass(frozen=True)
class SpreadChoice:
    """Which spread was kept, and what each measured: KL from dense as a multiple of the oracle's
    (mean over the held-out windows), on `windows` windows of `context` tokens, `scored` each."""

    choice: str
    kl_ratio: dict[str, float]
    context: int
    scored: int
    windows: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SpreadChoice:
        choice = cls(**json.loads(text))
        if choice.choice not in SPREADS:
            raise ValueError(f"unknown spread {choice.choice!r}")
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


def needs_measuring(config: InfiniGenConfig) -> bool:
    """Whether `config` leaves the spread to a measurement: allocation "auto" with a budget
    below the whole context (at the whole context both spreads keep everything)."""
    return config.policy == "infinigen" and config.allocation == "auto" and config.resolved_budget < 1.0


def resolve_allocation(knobs: SpeculationKnobs, artifact, config: InfiniGenConfig) -> SpeculationKnobs:
    """`knobs` with allocation "auto" replaced by the spread stored for `config`'s settings
    (uniform where the budget is the whole context). Raises if it has not been measured."""
    if knobs.allocation != "auto":
        return knobs
    if not needs_measuring(config):
        return replace(knobs, allocation=SPREADS[0])
    choice = stored_choice(artifact, config)
    if choice is None:
        raise ValueError(
            "allocation 'auto' is chosen by a measurement on the model that has not been made for these "
            "settings: attach the model (`infinigen.attach`), whose session measures it, or set "
            f"allocation to one of {', '.join(SPREADS)}"
        )
    return replace(knobs, allocation=choice.choice)
