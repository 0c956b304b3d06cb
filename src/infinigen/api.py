"""`infinigen.attach`: calibrate the model if it needs it, then hand out a `Session`.

This is the one public entry point above the calibration step. It makes a `Calibrator` for the
model (`infinigen.calibration`), which loads the given or cached skew artifact or calibrates a
new one and measures what the artifact lacks, and gives the session that calibrator as its
`source`, so that a configuration the session does not hold yet is calibrated on first use.
The session itself (`infinigen.attach.Session`) only reads what calibration made.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from infinigen.attach import Session
from infinigen.calibration import Calibrator
from infinigen.config import InfiniGenConfig
from infinigen.measure.recall import recall_observer_for
from infinigen.skew import SkewArtifact


def attach(
    model: nn.Module,
    config: InfiniGenConfig | None = None,
    *,
    skew: SkewArtifact | str | Path | None = None,
    tokenizer=None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> Session:
    """Attach InfiniGen to `model` and return the session (`infinigen.attach.Session`); use it as a
    context manager (``with attach(model, cfg) as session:``), or call `session.detach()`.

    On the first use of a model (and partial ratio) this calibrates it once (see
    `infinigen.calibration`; a message says what, about how long and where, progress bars how
    far). The float32 and bfloat16 copies of a model share their calibration. skew: an artifact or
    its path (default: the cached one, calibrated on the default text with `tokenizer` if there is
    none); progress: show what calibration does."""
    config = config or InfiniGenConfig()
    calibrator = Calibrator(model, tokenizer, cache_dir, progress, given=skew)
    if not config.spec.calibrated:
        return Session(model, config, tokenizer=tokenizer, source=calibrator, observer_for=recall_observer_for)
    config.check_layers(calibrator.adapter.num_layers)
    with calibrator.locked(config):
        art = calibrator.skew_for(config)
        session = Session(
            model, config, artifact=art, tokenizer=tokenizer, source=calibrator, observer_for=recall_observer_for
        )
        try:
            calibrator.complete(session, art, config)
        except BaseException:
            session.detach()
            raise
    return session
