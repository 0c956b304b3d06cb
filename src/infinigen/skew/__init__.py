"""Skew (offline, once per model): calibration, the artifact (save / load / verify), channel choice.

`obtain_artifact` is what `infinigen.attach` calls: the given artifact, else the cached one,
else a fresh calibration (saved for next time) — verified against the model either way.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from infinigen.paths import default_cache_dir
from infinigen.skew.artifact import SkewArtifact, SkewArtifactError, artifact_path, model_fingerprint
from infinigen.skew.calibrate import (
    calibrate,
    calibration_ids,
    calibration_text,
    collect_qk,
    default_calibration_tokens,
    synthetic_calibration_ids,
)
from infinigen.skew.channels import query_mass_in_channels, skew_from_qk


def calibration_length(calibration_tokens: int | None, adapter) -> int:
    """Tokens to calibrate over: as asked, else the model's context (at most 8192)."""
    return min(calibration_tokens or default_calibration_tokens(adapter), adapter.max_positions)


def obtain_artifact(
    model,
    adapter,
    fingerprint: str,
    knobs,
    source: SkewArtifact | str | Path | None = None,
    tokenizer=None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> SkewArtifact:
    """The skew artifact for `model` and `knobs` (partial_ratio, skew, calibration_tokens).

    source: an artifact or a path to one (refused if it does not match), else the cached one
    under `cache_dir`, else calibrated now on the shipped prose (`tokenizer`; without one, on
    seeded random ids) and saved there. The model must not be folded yet."""
    ratio, skewed = knobs.partial_ratio, knobs.skew
    if isinstance(source, SkewArtifact):
        source.verify(fingerprint, ratio, skewed, adapter.num_layers, "given artifact")
        return source
    if source is not None:
        art = SkewArtifact.load(source)
        art.verify(fingerprint, ratio, skewed, adapter.num_layers, str(source))
        return art
    tokens = calibration_length(knobs.calibration_tokens, adapter)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = artifact_path(folder, model.config.model_type, fingerprint, ratio, skewed, tokens)
    if path.is_file():
        art = SkewArtifact.load(path)
        art.verify(fingerprint, ratio, skewed, adapter.num_layers, str(path))
        return art
    if tokenizer is not None:
        ids = calibration_ids(tokenizer, tokens)
    else:
        ids = synthetic_calibration_ids(model.config.vocab_size, tokens)
    art = calibrate(model, adapter, ids, ratio, skewed, fingerprint, progress)
    try:
        art.save(path)
    except OSError as exc:
        warnings.warn(
            f"could not save the skew artifact to {path} ({exc}); it will be recomputed next time", stacklevel=2
        )
    return art


__all__ = [
    "SkewArtifact",
    "SkewArtifactError",
    "artifact_path",
    "calibrate",
    "calibration_ids",
    "calibration_length",
    "calibration_text",
    "collect_qk",
    "default_calibration_tokens",
    "model_fingerprint",
    "obtain_artifact",
    "query_mass_in_channels",
    "skew_from_qk",
    "synthetic_calibration_ids",
]
