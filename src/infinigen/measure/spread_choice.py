"""The measurement by which calibration chooses the budget's spread and the correction target per
model (`infinigen.skew.choice` has the rule and the record): each candidate teacher-forced on
held-out text through an attached session, against dense and the oracle at the same budget."""

from __future__ import annotations

import math
import time

import torch

from infinigen.config import InfiniGenConfig
from infinigen.measure.forced import ForcedRunner, Prefix
from infinigen.measure.metrics import kl_divergence
from infinigen.progress import bar as progress_bar
from infinigen.progress import ticking
from infinigen.skew import calibration_length, calibration_text
from infinigen.skew.calibrate import stdlib_source
from infinigen.skew.choice import CORRECTION_TARGETS, KL_AIM, SPREADS, MeasuredChoice, choose_target

# Each held-out window is as long as the calibration (the model's context, at most 8192 tokens by
# default): the length the skew is fitted for. Shorter windows understate the loss at that length
# (the KL against the oracle's grows with the context).
SCORED = 128  # teacher-forced positions scored per window
# Standard-library packages the calibration (json, email, asyncio) and the `code` evaluation
# genre (top-level modules) do not read: the held-out source code.
HELD_OUT_CODE_PACKAGES = ("unittest", "logging", "importlib", "concurrent")
_CODE_CHARS = 120_000
KEEP_PREFILL_BYTES = 2 << 30  # prefills kept between batches of candidates (a small model's windows fit)
_SYNTHETIC_SEED = 1  # without a tokenizer: seeded random ids (the calibration uses seed 0)


def held_out_ids(tokenizer, vocab_size: int, length: int) -> list[torch.Tensor]:
    """The held-out windows [length] (see the module docstring): the essay's opening and, where
    the packages are found, standard-library source; seeded random ids without a tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(_SYNTHETIC_SEED)
        return [torch.randint(0, vocab_size, (length,), generator=g)]
    windows = []
    for text in (calibration_text(), held_out_code()):
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt", verbose=False).input_ids[0]
        if ids.numel() >= length:
            windows.append(ids[:length])
    if not windows:
        raise ValueError(f"no held-out text of {length} tokens to choose the budget spread with")
    return windows


def held_out_code() -> str:
    """Python source of `HELD_OUT_CODE_PACKAGES` from this interpreter's standard library, files
    in name order, about `_CODE_CHARS` characters ("" where none is found)."""
    return stdlib_source(HELD_OUT_CODE_PACKAGES, _CODE_CHARS)


class _HeldOut:
    """The held-out windows of one measurement, each with dense's logits and the oracle's KL,
    computed once: candidates are scored against them. A window's prefill (the longest part of a
    measurement, worth several forced runs) is kept for a later batch of
    candidates while the kept ones hold at most `KEEP_PREFILL_BYTES`, else redone."""

    def __init__(self, session, windows: list[torch.Tensor], scored: int, oracle: InfiniGenConfig, bar) -> None:
        self.runner = ForcedRunner(session.model, session)
        self.windows, self.scored, self.oracle, self.bar = windows, scored, oracle, bar
        self.dense: list[torch.Tensor] = []
        self.oracle_kl: list[float] = []
        self.kept: dict[int, Prefix] = {}

    def ratios(self, candidates: dict) -> dict:
        """Per candidate (key -> config), its KL from dense as a multiple of the oracle's, mean over
        the windows. A window where the oracle's KL is zero compares the KL (+1, so that the ratio
        stays defined)."""
        out: dict = {key: [] for key in candidates}
        for w, ids in enumerate(self.windows):
            t0 = ids.shape[0] - self.scored
            prefix = self.kept.get(w)
            if prefix is None:
                self.bar.set_postfix_str(f"prefill of window {w + 1}")
                prefix = self.runner.prefill(ids[:t0][None])
                self.bar.update(1)
                self.bar.set_postfix_str("")
            chunk = ids[t0:][None]
            if w == len(self.dense):
                self.dense.append(self.runner.run(prefix, chunk, InfiniGenConfig(policy="dense")).logits[0])
                self.bar.update(1)
                self.oracle_kl.append(
                    kl_divergence(self.dense[w], self.runner.run(prefix, chunk, self.oracle).logits[0])
                )
                self.bar.update(1)
            base = self.oracle_kl[w]
            for key, cfg in candidates.items():
                kl = kl_divergence(self.dense[w], self.runner.run(prefix, chunk, cfg).logits[0])
                out[key].append(kl / base if base > 0 else 1.0 + kl)
                self.bar.update(1)
            if (
                w not in self.kept
                and _cache_bytes(prefix) + sum(map(_cache_bytes, self.kept.values())) <= KEEP_PREFILL_BYTES
            ):
                self.kept[w] = prefix
            del prefix
        return {key: sum(v) / len(v) for key, v in out.items()}


def _cache_bytes(prefix: Prefix) -> int:
    """What a prefill's cache holds (its keys and values)."""
    return sum(t.nbytes for layer in prefix.cache.layers for t in (layer.keys, layer.values) if torch.is_tensor(t))


def runs_needed(windows: int, spreads: int = len(SPREADS)) -> int:
    """The progress bar's steps of a measurement that needs no stricter target: per window its
    prefill, dense, the oracle and each spread (each stricter target run adds a step per window)."""
    return windows * (3 + spreads)


@torch.no_grad()
def measure(session, config: InfiniGenConfig, progress: bool = True, about: str | None = None) -> MeasuredChoice:
    """Teacher-force the candidates on the held-out windows through `session` (an attached session
    of the model), every setting but the spread and the target as `config` has them, and keep what
    `infinigen.skew.choice` says: the spread with the smaller KL as a multiple of the oracle's (at
    the least correction), then the least correction within the aim. about: what the whole
    measurement should take (said beside its clock: its runs differ too much in length, a window's
    prefill being several runs' worth, for a rate of runs to foretell the rest)."""
    started = time.perf_counter()
    adapter = session.adapter
    length = min(calibration_length(config.calibration_tokens, adapter), adapter.max_positions)
    scored = min(SCORED, max(length // 4, 1))
    windows = held_out_ids(session.tokenizer, session.model.config.vocab_size, length)
    first = CORRECTION_TARGETS[0]
    oracle = config.replace(policy="oracle", budget=config.resolved_budget)
    clock = "{elapsed}" + (f" of about {about}" if about else "")
    bar = progress_bar(
        total=runs_needed(len(windows)),
        desc="choosing the budget spread and correction target",
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} runs [" + clock + "{postfix}]",
        disable=not progress,
        leave=False,
    )
    with ticking(bar):
        held = _HeldOut(session, windows, scored, oracle, bar)
        mean = held.ratios({name: config.replace(allocation=name, correction_target=first) for name in SPREADS})
        best = min(SPREADS, key=mean.__getitem__)  # the first of equals: uniform
        if any(math.isnan(v) for v in mean.values()):
            best = SPREADS[0]
        by_target = {first: mean[best]}
        if not mean[best] <= KL_AIM:
            by_target.update(_stricter_targets(session, held, config.replace(allocation=best), by_target))
    return MeasuredChoice(
        allocation=best,
        correction_target=choose_target(by_target),
        kl_ratio=mean,
        target_kl_ratio={f"{t:g}": r for t, r in by_target.items()},
        context=length,
        scored=scored,
        windows=len(windows),
        budget=config.resolved_budget,
        seconds=round(time.perf_counter() - started, 1),
        partial_format=config.partial_format,
    )


def _stricter_targets(session, held: _HeldOut, config: InfiniGenConfig, measured: dict[float, float]) -> dict:
    """KL ratios of the targets after the first: run only those whose top-ups differ from a
    target's already measured (equal top-ups select the same positions: the same KL)."""
    seen = {_top_ups(session, config.replace(correction_target=t)): t for t in measured}
    runs, same = {}, {}
    for t in CORRECTION_TARGETS[1:]:
        key = _top_ups(session, config.replace(correction_target=t))
        if key in seen:
            same[t] = seen[key]
        else:
            seen[key] = t
            runs[t] = config.replace(correction_target=t)
    if runs:
        held.bar.total += len(held.windows) * len(runs)
        held.bar.refresh()
    out = held.ratios(runs) if runs else {}
    for t, twin in same.items():
        out[t] = measured[twin] if twin in measured else out[twin]
    return out


def _top_ups(session, config: InfiniGenConfig) -> tuple:
    """The per-layer top-ups `config` (every setting explicit) fetches in `session`."""
    return tuple(sorted(session.selector_for(config).layer_corrections.items()))
