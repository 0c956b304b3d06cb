"""Skew (offline, once per model): calibration, the artifact (save / load / verify), channel choice.

`infinigen.calibration` uses these: the given artifact (`load_given`), else the cached one
(`load_cached`), else a fresh calibration (`calibrate_skew`) — verified against the model either
way. An artifact that cannot be used is never used: a cached one is recalibrated and replaced
(with a warning), a given one is refused with the command that recomputes it.
"""

from __future__ import annotations

import shlex
import warnings
from collections.abc import Callable
from pathlib import Path

from infinigen.paths import default_cache_dir
from infinigen.skew.artifact import SkewArtifact, SkewArtifactError, artifact_path, model_fingerprint, needs_of
from infinigen.skew.calibrate import (
    SYNTHETIC_SOURCE,
    calibrate,
    calibration_ids,
    calibration_text,
    collect_qk,
    default_calibration_source,
    default_calibration_tokens,
    synthetic_calibration_ids,
    text_calibration_source,
)
from infinigen.skew.channels import query_mass_in_channels, skew_from_qk


class SkewArtifactWarning(UserWarning):
    """A cached skew artifact could not be used and is being recalibrated."""


def calibration_length(calibration_tokens: int | None, adapter) -> int:
    """Tokens to calibrate over: as asked, else the model's context (at most 8192)."""
    return min(calibration_tokens or default_calibration_tokens(adapter), adapter.max_positions)


def check_calibration_source(art: SkewArtifact, path: Path, tokenizer_given: bool) -> None:
    """Refuse a cached artifact made on another default text than today's (an older version's,
    another interpreter's library sources, or one that says nothing), and one made on seeded
    random ids when a tokenizer now allows real text. One calibrated on the user's own text
    (`infinigen skew --calibration-file`) is theirs and stays."""
    made_on = art.meta.get("calibration")
    default = default_calibration_source()
    if made_on == default or (made_on or "").startswith("file:"):
        return
    if made_on == SYNTHETIC_SOURCE and not tokenizer_given:
        return
    if made_on == SYNTHETIC_SOURCE:
        reason = f"was calibrated on {SYNTHETIC_SOURCE}, and real text ({default}) is now at hand"
    else:
        reason = (
            f"was calibrated on {f'other text ({made_on})' if made_on else 'an older default text'}, not on {default}"
        )
    raise SkewArtifactError(f"skew artifact {path} {reason}", path, reason)


def skew_command(knobs, output: str | Path, model: str | None = None) -> str:
    """The `infinigen skew` command that computes the artifact `knobs` ask for into `output`."""
    parts = ["infinigen skew"]
    if model:
        parts.append(f"--model {shlex.quote(str(model))}")
    parts.append(f"--partial-ratio {knobs.partial_ratio:g}")
    if not knobs.skew:
        parts.append("--no-skew")
    if knobs.calibration_tokens is not None:
        parts.append(f"--calibration-tokens {knobs.calibration_tokens}")
    parts.append(f"--output {shlex.quote(str(output))}")
    return " ".join(parts)


def beside(path: Path, knobs) -> Path:
    """A file next to `path` named for `knobs`' artifact (`x.safetensors` -> `x-r0.3.safetensors`)."""
    return path.with_name(f"{path.stem}-r{knobs.partial_ratio:g}{'' if knobs.skew else '-noskew'}{path.suffix}")


def refuse_given(exc: SkewArtifactError, knobs, model: str | None = None) -> SkewArtifactError:
    """`exc` about a given artifact file, with the way out: the exact command that computes the
    artifact `knobs` ask for (`model`: the command line's --model; without it, the command is the
    default model's). Into the given file only if it is missing or unusable; a sound artifact of
    another model or other settings is kept, and the command writes beside it."""
    if exc.path is None:
        return exc
    hint = "" if model else " (with --model for a model other than the default)"
    if exc.sound:
        out = beside(exc.path, knobs)
        way = f"so it is not used (and is kept): compute this run's with `{skew_command(knobs, out, model)}`{hint} "
        way += f"and give --skew-file {shlex.quote(str(out))}"
    else:
        verb = "compute" if exc.reason == "was not found" else "so it is not used: recompute"
        way = f"{verb} it with `{skew_command(knobs, exc.path, model)}`{hint}"
    return SkewArtifactError(
        f"skew artifact {exc.path} {exc.reason}, {way}, or go without it (the cached artifact, calibrated if needed)",
        exc.path,
        exc.reason,
        exc.sound,
    )


def cached_path(model, adapter, fingerprint: str, knobs, cache_dir: str | Path | None = None) -> Path:
    """Where the cached artifact of `model` and `knobs` (partial_ratio, skew, calibration_tokens) lives."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokens = calibration_length(knobs.calibration_tokens, adapter)
    return artifact_path(folder, model.config.model_type, fingerprint, knobs.partial_ratio, knobs.skew, tokens)


def adopted(art: SkewArtifact, fingerprint: str, exact: Callable[[], str] | None) -> SkewArtifact:
    """`art` keyed by today's `fingerprint` if an earlier version made it for this very model,
    keyed by its exact bytes (`exact`: that fingerprint, computed only then), so that an upgrade
    recalibrates nothing; any other artifact as it is (its verification refuses it)."""
    if art.fingerprint != fingerprint and exact is not None and art.fingerprint == exact():
        art.fingerprint = fingerprint
    return art


def load_given(
    source: SkewArtifact | str | Path, fingerprint: str, knobs, num_layers: int, exact: Callable[[], str] | None = None
) -> SkewArtifact:
    """The artifact the user gave (in memory, or a file), verified against the model and `knobs`
    (`exact`: see `adopted`); refused, with the command that recomputes it, if it cannot be read,
    is damaged or does not match."""
    needs = needs_of(knobs)
    if isinstance(source, SkewArtifact):
        adopted(source, fingerprint, exact).verify(fingerprint, knobs.partial_ratio, knobs.skew, num_layers, **needs)
        return source
    try:
        art = adopted(SkewArtifact.load(source), fingerprint, exact)
        art.verify(fingerprint, knobs.partial_ratio, knobs.skew, num_layers, source, **needs)
    except SkewArtifactError as exc:
        raise refuse_given(exc, knobs) from None
    return art


def load_cached(
    path: Path, fingerprint: str, knobs, num_layers: int, tokenizer_given: bool, exact: Callable[[], str] | None = None
) -> SkewArtifact | None:
    """The cached artifact at `path` if it can serve `knobs` (None if there is none; `exact`: see
    `adopted`); one that cannot (damaged, of an old format, made for other settings or on another
    default text, or lacking a table `knobs` read) is reported with a `SkewArtifactWarning` and not
    used: the caller recalibrates and replaces it."""
    if not path.is_file():
        return None
    try:
        art = adopted(SkewArtifact.load(path), fingerprint, exact)
        art.verify(fingerprint, knobs.partial_ratio, knobs.skew, num_layers, path, **needs_of(knobs))
        check_calibration_source(art, path, tokenizer_given=tokenizer_given)
    except SkewArtifactError as exc:
        warnings.warn(
            f"the cached skew artifact {path} {exc.reason}: recalibrating and replacing it",
            SkewArtifactWarning,
            stacklevel=3,
        )
        return None
    art.origin = path
    return art


def calibrate_skew(model, adapter, fingerprint: str, knobs, tokenizer=None, progress: bool = True, text=None):
    """A fresh artifact (skew, channels and the per-layer tables) for `model` and `knobs`, calibrated
    on the default calibration text of prose and code (`calibration_ids`), or on `text`; without a
    tokenizer on seeded random ids. The model must not be folded."""
    tokens = calibration_length(knobs.calibration_tokens, adapter)
    if tokenizer is not None:
        ids = calibration_ids(tokenizer, tokens, text)
        source = default_calibration_source() if text is None else text_calibration_source(text)
    else:
        ids, source = synthetic_calibration_ids(model.config.vocab_size, tokens), SYNTHETIC_SOURCE
    return calibrate(model, adapter, ids, knobs.partial_ratio, knobs.skew, fingerprint, progress, source=source)


__all__ = [
    "SkewArtifact",
    "SkewArtifactError",
    "SkewArtifactWarning",
    "adopted",
    "artifact_path",
    "calibrate",
    "calibration_ids",
    "calibration_length",
    "calibration_text",
    "check_calibration_source",
    "collect_qk",
    "default_calibration_source",
    "default_calibration_tokens",
    "model_fingerprint",
    "calibrate_skew",
    "cached_path",
    "load_cached",
    "load_given",
    "query_mass_in_channels",
    "refuse_given",
    "skew_command",
    "skew_from_qk",
    "synthetic_calibration_ids",
    "text_calibration_source",
]
