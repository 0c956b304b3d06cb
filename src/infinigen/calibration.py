"""The one calibration step (`infinigen.attach`, in `infinigen.api`, runs it on first use).

Everything measured per model is made here and stored as concrete values in the skew artifact;
the runtime (the attach session, the cache, the selectors) only reads it:

1. the skew, partial channels and per-layer tables (`infinigen.skew.calibrate`): one pass of the
   model over the calibration text (prose and code, as long as the model's context, <= 8192);
2. the budget's spread over the layers and the correction target (`infinigen.skew.choice`), by
   teacher-forcing each candidate on held-out text against dense and the oracle
   (`infinigen.measure.spread_choice`), once, at the reference budget: it serves every budget.

The artifact is cached under `~/.cache/infinigen` (`INFINIGEN_CACHE_DIR`) by a fingerprint of the
model's weights (rounded to bfloat16: a model's float32 and bfloat16 copies share it) and config. A process that finds another one calibrating the same artifact waits
for it (a lock file under the cache's `locks/` folder) and then reads what it stored.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from infinigen.attach import Session
from infinigen.config import InfiniGenConfig, SpeculationKnobs
from infinigen.measure.spread_choice import measure, runs_needed
from infinigen.models import get_adapter
from infinigen.progress import duration, step
from infinigen.select import measured_choice, reads_choice
from infinigen.skew import (
    SkewArtifact,
    SkewArtifactWarning,
    cached_path,
    calibrate_skew,
    calibration_length,
    load_cached,
    load_given,
    model_fingerprint,
)
from infinigen.skew.calibrate import rope_state_kept
from infinigen.skew.choice import REFERENCE_BUDGET, MeasuredChoice, store_choice


def reference_config(config: InfiniGenConfig) -> InfiniGenConfig:
    """The settings the choice is measured at: the artifact's own (partial ratio, skew,
    calibration length) at the reference budget, every other setting at its default, so that the
    one measurement is the same whichever configuration first asks for it."""
    return InfiniGenConfig(
        policy="infinigen",
        budget=REFERENCE_BUDGET,
        partial_ratio=config.partial_ratio,
        skew=config.skew,
        calibration_tokens=config.calibration_tokens,
    )


def say(progress: bool, text: str) -> None:
    """A line about long work, on stderr (stdout may carry JSON)."""
    if progress:
        print(f"[infinigen] {text}", file=sys.stderr, flush=True)


# What each phase of the first use costs, in forwards of the model over the calibration text (the
# probe's time scaled): capturing queries and keys (one forward with hooks on every layer), the
# per-layer tables (float32 tensor work on what was captured) and the measurement of the choice
# (held-out window prefills, then teacher-forced runs). Measured per phase: docs/results.md.
PHASE_FORWARDS = {"capture": 1.3, "tables": 1.6, "measure": 3.9}
PROBE_TOKENS = 512  # the timed forwards behind the estimate (three: a small part of the first use)


@torch.no_grad()
def forward_seconds(model: nn.Module, adapter, tokens: int) -> float:
    """About how long one forward of `model` over `tokens` takes here: a forward of
    `PROBE_TOKENS` tokens, timed, scaled to `tokens` by the forward's arithmetic (the weights'
    linear in the tokens; attention quadratic, up to a layer's window). Under load the probe
    slows with the work it predicts."""
    n = min(tokens, PROBE_TOKENS)
    ids = torch.zeros(1, n, dtype=torch.long, device=next(model.parameters()).device)
    times = []
    with rope_state_kept(model):
        for _ in range(3):  # the first run pays for kernels made per shape; the least of the others
            started = time.perf_counter()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            _sync(ids.device)
            times.append(time.perf_counter() - started)
    return min(times[1:]) / forward_flops(model, adapter, n) * forward_flops(model, adapter, tokens)


def forward_flops(model: nn.Module, adapter, tokens: int) -> float:
    """The arithmetic of one forward over `tokens`: the weights (the embeddings aside), and
    attention over half the context on average (a sliding layer's window at most)."""
    embeddings = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    weights = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    keys = sum(min(tokens / 2, adapter.window(i) or tokens) for i in range(adapter.num_layers))
    return 2 * weights * tokens + 4 * adapter.num_heads * adapter.head_dim * tokens * keys


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Calibrator:
    """Makes complete artifacts for one model: the given one, else the cached one, else a fresh
    calibration; then the measured choice if the artifact lacks it (saved with a cached one; a
    given file is never rewritten). A session calls it (`Session(source=...)`) for a
    configuration whose artifact it does not hold yet."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        cache_dir: str | Path | None = None,
        progress: bool = True,
        given: SkewArtifact | str | Path | None = None,
    ) -> None:
        self.model, self.tokenizer, self.cache_dir = model, tokenizer, cache_dir
        self.progress, self.given = progress, given
        self.adapter = get_adapter(model)
        self.fingerprint = model_fingerprint(model)
        self._exact: str | None = None
        # Seconds per forward over the calibration text, as the phases run so far took it (the
        # probe's estimate, corrected by what capture and tables really took): the measure's clock.
        self._forward: float | None = None

    # ------------------------------------------------------------------ the two parts
    def skew_for(self, config: InfiniGenConfig) -> SkewArtifact:
        """The artifact of `config`'s skew settings, without the measured choice if it is new.
        The model must be as loaded (not folded); call it under `locked`."""
        if self.given is not None:
            return load_given(self.given, self.fingerprint, config, self.adapter.num_layers, self.exact_fingerprint)
        path = self.path(config)
        art = self.cached(config, path)
        if art is not None:
            return art
        art = self.calibrate(config, text=None, kept_in=path)
        self._save(art, path)
        return art

    def calibrate(
        self, config: InfiniGenConfig, text: str | None, kept_in: Path, why: str = "first use of this model"
    ) -> SkewArtifact:
        """A fresh artifact of `config`'s skew settings (without the measured choice), on `text` or
        the default text; says first what it will do and about how long each phase takes here."""
        tokens = calibration_length(config.calibration_tokens, self.adapter)
        measured = reads_choice(config)
        if self.progress:
            source = "prose and code" if text is None else "the given text"
            source = source if self.tokenizer is not None else "seeded random ids (no tokenizer)"
            with step("timing a forward for the estimate", True):
                self._forward = forward_seconds(self.model, self.adapter, tokens)
            phases = ("capture", "tables", "measure") if measured else ("capture", "tables")
            total = sum(PHASE_FORWARDS[p] for p in phases) * self._forward
            each = ", ".join(f"{p} {duration(PHASE_FORWARDS[p] * self._forward)}" for p in phases)
            say(
                True,
                f"{why}: calibrating it once for partial_ratio {config.partial_ratio:g} "
                f"({self.adapter.num_layers} layers; {tokens} tokens of {source})"
                + (", then measuring the budget's spread and correction target on held-out text" if measured else "")
                + f": about {duration(total)} on this machine ({each}; a timed forward, scaled); kept in {kept_in}",
            )
        started = time.perf_counter()
        art = calibrate_skew(self.model, self.adapter, self.fingerprint, config, self.tokenizer, self.progress, text)
        took = time.perf_counter() - started
        art.meta["calibration_seconds"] = f"{took:.1f}"
        self._forward = took / (PHASE_FORWARDS["capture"] + PHASE_FORWARDS["tables"])
        return art

    def cached(self, config: InfiniGenConfig, path: Path) -> SkewArtifact | None:
        """The cached artifact at `path` if it serves `config`; else, if there is no file there,
        the one an earlier version cached for this very model under its exact-bytes fingerprint
        (`model_fingerprint`), saved at `path` now: an upgrade recalibrates nothing."""
        layers, real_text = self.adapter.num_layers, self.tokenizer is not None
        art = load_cached(path, self.fingerprint, config, layers, real_text)
        if art is not None or path.is_file():
            return art
        old = cached_path(self.model, self.adapter, self.exact_fingerprint(), config, self.cache_dir)
        if old == path or not old.is_file():
            return None
        art = load_cached(old, self.fingerprint, config, layers, real_text, exact=self.exact_fingerprint)
        if art is not None:
            self._save(art, path)
        return art

    def exact_fingerprint(self) -> str:
        """The model's fingerprint by its exact bytes, as earlier versions keyed artifacts
        (computed once, only when one is looked for: the model must be as loaded)."""
        if self._exact is None:
            self._exact = model_fingerprint(self.model, exact=True)
        return self._exact

    def complete(self, session: Session, artifact: SkewArtifact, config: InfiniGenConfig) -> None:
        """Measure the choice through `session` (attached, holding `artifact`) if `config` reads it
        and `artifact` lacks it; store it, and save a cached artifact."""
        if not reads_choice(config) or measured_choice(artifact) is not None:
            return
        choice = self.measure(session, config)
        store_choice(artifact, choice)
        if artifact.origin is not None:
            self._save(artifact, artifact.origin)

    def measure(self, session: Session, config: InfiniGenConfig) -> MeasuredChoice:
        reference = reference_config(config)
        length = min(calibration_length(config.calibration_tokens, self.adapter), self.adapter.max_positions)
        about = None
        if self.progress:
            if self._forward is None:  # the skew was calibrated earlier: time a forward now
                self._forward = forward_seconds(self.model, self.adapter, length)
            about = duration(PHASE_FORWARDS["measure"] * self._forward)
        say(
            self.progress,
            f"measuring the budget's spread and correction target: {runs_needed(2)} teacher-forced runs on held-out "
            f"windows of {length} tokens, at a {REFERENCE_BUDGET:.0%} budget (one measurement serves every budget)"
            + (f": about {about}" if about else ""),
        )
        choice = measure(session, reference, progress=self.progress, about=about)
        say(
            self.progress,
            f"chosen in {choice.seconds:.0f} s: spread {choice.allocation}, correction target "
            f"{choice.correction_target:g} (KL x the oracle's: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(choice.kl_ratio.items()))
            + ")",
        )
        return choice

    # ------------------------------------------------------------------ a session's source
    def __call__(self, session: Session, config: InfiniGenConfig) -> SkewArtifact:
        """The complete artifact of `config` for an attached `session`."""
        with self.locked(config):
            art = self.skew_for(config)
            session.hold(config, art)
            self.complete(session, art, config)
        return art

    # ------------------------------------------------------------------ files
    def path(self, config: InfiniGenConfig) -> Path:
        return cached_path(self.model, self.adapter, self.fingerprint, config, self.cache_dir)

    @contextlib.contextmanager
    def locked(self, config: InfiniGenConfig) -> Iterator[None]:
        """Hold the lock of `config`'s cached artifact: a second process waits here for the
        first one's calibration, then finds it complete. Without a writable cache folder, or with
        a given artifact, nothing is shared and nothing is locked."""
        if self.given is not None:
            yield
            return
        artifact = self.path(config)
        lock = artifact.parent.parent / "locks" / f"{artifact.stem}.lock"  # beside the cache's folders
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                say(self.progress, f"another process is calibrating this model: waiting for it ({lock})")
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _save(self, art: SkewArtifact, path: Path) -> None:
        try:
            art.save(path)
            art.origin = path
        except OSError as exc:
            warnings.warn(
                f"could not save the skew artifact to {path} ({exc.strerror or exc}); it will be calibrated again "
                "next time (set INFINIGEN_CACHE_DIR to a writable folder)",
                SkewArtifactWarning,
                stacklevel=3,
            )


def calibrate_to_file(
    model: nn.Module,
    tokenizer,
    config: InfiniGenConfig,
    output: str | Path | None = None,
    text: str | None = None,
    progress: bool = True,
) -> tuple[SkewArtifact, Path]:
    """What `infinigen skew` does: calibrate `model` for `config` now (on `text`, else the
    default text), measure the choice, and save the artifact to `output` (default: the cache)."""
    calibrator = Calibrator(model, tokenizer, progress=progress)
    out = Path(output) if output is not None else calibrator.path(config)
    with calibrator.locked(config):
        art = calibrator.calibrate(config, text, kept_in=out, why="asked to calibrate this model")
        with Session(model, config, artifact=art, tokenizer=tokenizer) as session:
            store_choice(art, calibrator.measure(session, config))
        art.save(out)
        art.origin = out
    return art, out


def report(
    model: nn.Module, tokenizer, config: InfiniGenConfig, artifact: SkewArtifact, text: str | None = None
) -> list[str]:
    """What `infinigen skew` prints about an artifact: the measured choice, the query mass its
    partial channels hold (skewed and not) on held-out text (the essay's opening, whose end the
    default calibrates on; or the first half of the user's text), and the correction's top-ups."""
    from infinigen.select import corrections_chosen, resolve_measured
    from infinigen.skew import calibration_ids, calibration_text, collect_qk, query_mass_in_channels, skew_from_qk

    adapter = get_adapter(model)
    lines = []
    choice = measured_choice(artifact)
    if choice is not None:
        spreads = ", ".join(f"{name} {ratio:.2f}" for name, ratio in sorted(choice.kl_ratio.items()))
        targets = ", ".join(f"{t} {ratio:.2f}" for t, ratio in choice.target_kl_ratio.items())
        lines += [
            f"budget spread (allocation auto): {choice.allocation}; KL as a multiple of the oracle's on held-out "
            f"text at a {choice.budget:g} budget: {spreads} ({choice.windows} windows of {choice.context} tokens)",
            f"correction target (left unset): {choice.correction_target:g}; by target: {targets} "
            "(the least correction within the aim is kept)",
        ]
    tokens = artifact.calibration_tokens
    held_text = text[: len(text) // 2] if text is not None else None
    if held_text is None:
        held = tokenizer(calibration_text(), add_special_tokens=False, return_tensors="pt").input_ids
        held = held[:, : min(1024, tokens)]
    else:
        held = calibration_ids(tokenizer, min(1024, tokens), text=held_text)
    qs, ks = collect_qk(model, adapter, held, progress=False)
    plain = skewed = 0.0
    for i in range(adapter.num_layers):
        _, c_plain = skew_from_qk(qs[i], ks[i], adapter.num_kv_heads, config.partial_ratio, skewed=False)
        plain += query_mass_in_channels(qs[i], None, c_plain)
        skewed += query_mass_in_channels(qs[i], artifact.skews[i], artifact.channels[i])
    lines.append(
        f"query mass (Σq²) in the top-{config.partial_ratio:.0%} channels, mean over layers: "
        f"unskewed {plain / adapter.num_layers:.3f}, skewed {skewed / adapter.num_layers:.3f}"
    )
    cfg = config.replace(policy="infinigen").in_read_units(adapter.head_dim, next(model.parameters()).dtype)
    top_ups = ", ".join(f"{i}: {c:.1%}" for i, c in sorted(corrections_chosen(cfg, adapter, artifact).items()))
    target = resolve_measured(cfg.knobs(SpeculationKnobs), artifact, cfg).correction_target
    how = (
        f"chosen per layer: above {target:g}x the oracle's output error"
        if cfg.correction is None
        else f"{cfg.correction:g} everywhere"
    )
    lines.append(
        f"correction at a {cfg.resolved_budget:.0%} budget ({how}): top-ups of the context by layer: {top_ups or 'none'}"
    )
    return lines
