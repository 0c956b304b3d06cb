"""What calibration measures end to end and the runtime only reads: the budget's spread over the
speculated layers and the correction target, chosen per model and stored in the skew artifact as
concrete values.

Neither spread is best on every model (the calibrated one, per-layer fractions from the oracle's
recall curves, on SmolLM2-135M; the uniform one on Gemma-3-270m), and the per-layer output error
that decides which layers the correction tops up understates the end loss on some models. So
calibration teacher-forces each candidate on held-out text against dense and the oracle
(`infinigen.measure.spread_choice`) and keeps:

1. the spread whose KL from dense is the smaller multiple of the oracle's (uniform on a tie), at
   the least correction (`CORRECTION_TARGETS[0]`);
2. the first of `CORRECTION_TARGETS` (least correction first) whose KL is within `KL_AIM` times
   the oracle's, else the one of least KL.

The measurement runs once per artifact, at `REFERENCE_BUDGET` and the default settings, and
serves every budget and setting: the choice is a property of the model (docs/results.md, "What
calibration chose per model": the same at 5 % and 20 %). `allocation="auto"` and an unset `correction_target` read it;
explicit values override it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

SPREADS = ("uniform", "calibrated")  # the candidates, uniform first (it wins ties)
CORRECTION_TARGETS = (1.5, 1.25, 1.1)  # least correction first
KL_AIM = 1.2  # the KL from dense, as a multiple of the oracle's, a target must reach
REFERENCE_BUDGET = 0.1  # the fetched fraction the choice is measured at
META_KEY = "measured_choice"


@dataclass(frozen=True)
class MeasuredChoice:
    """The spread and the correction target kept, and what each candidate measured: KL from dense
    as a multiple of the oracle's (mean over `windows` held-out windows of `context` tokens,
    `scored` scored each) per spread (`kl_ratio`, at the least correction) and per target run
    with the chosen spread (`target_kl_ratio`, keyed by the target's `:g` text)."""

    allocation: str
    correction_target: float
    kl_ratio: dict[str, float]
    target_kl_ratio: dict[str, float]
    context: int
    scored: int
    windows: int
    budget: float = REFERENCE_BUDGET
    seconds: float = field(default=0.0, compare=False)
    partial_format: str = ""  # how the partial keys were kept when it was measured ("": not recorded)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MeasuredChoice:
        choice = cls(**json.loads(text))
        if choice.allocation not in SPREADS:
            raise ValueError(f"unknown spread {choice.allocation!r}")
        if not choice.correction_target >= 1:
            raise ValueError(f"correction target {choice.correction_target!r} below 1")
        return choice

    def describe(self) -> dict:
        """What `summary()` reports of it: what was chosen, and by which measurement."""
        held_out = {"context": self.context, "scored_tokens": self.scored, "windows": self.windows}
        return {
            "allocation": self.allocation,
            "correction_target": self.correction_target,
            "measured_at_budget": self.budget,
            "held_out": held_out,
            "kl_ratio_by_spread": {k: round(v, 4) for k, v in self.kl_ratio.items()},
            "kl_ratio_by_target": {k: round(v, 4) for k, v in self.target_kl_ratio.items()},
            "rule": (
                f"the spread of least KL (x the oracle's), then the least correction within {KL_AIM:g}x, "
                "else the least KL"
            ),
        }


def stored_choice(artifact, partial_format: str | None = None) -> MeasuredChoice | None:
    """The choice `artifact` holds (None: not measured yet, unreadable, or, when `partial_format`
    is given, measured with the partial keys kept otherwise: a choice is measured at the reference
    settings of its time, and one of another format is measured again)."""
    text = artifact.meta.get(META_KEY)
    if text is None:
        return None
    try:
        choice = MeasuredChoice.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None
    return choice if partial_format is None or choice.partial_format == partial_format else None


def store_choice(artifact, choice: MeasuredChoice) -> None:
    artifact.meta[META_KEY] = choice.to_json()


def choose_target(ratios: dict[float, float]) -> float:
    """The first of `CORRECTION_TARGETS` measured in `ratios` (target -> KL as a multiple of the
    oracle's) within `KL_AIM`, else the one of least KL (the least correction of equals)."""
    measured = [t for t in CORRECTION_TARGETS if t in ratios]
    within = [t for t in measured if ratios[t] <= KL_AIM]
    if within:
        return within[0]
    return min(measured, key=lambda t: (ratios[t] if not math.isnan(ratios[t]) else math.inf, measured.index(t)))
