"""The measurement that chooses the budget's spread for allocation "auto" (`infinigen.spread`):
each spread teacher-forced on held-out text through the session that asks, against dense and the
oracle at the same budget."""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from infinigen.config import InfiniGenConfig
from infinigen.eval.forced import ForcedRunner
from infinigen.eval.metrics import kl_divergence
from infinigen.skew import calibration_length, calibration_text
from infinigen.skew.calibrate import stdlib_source
from infinigen.spread import SPREADS, SpreadChoice

CONTEXT = 4096  # tokens per held-out window (at most the calibration length)
SCORED = 128  # teacher-forced positions scored per window
# Standard-library packages the calibration (json, email, asyncio) and the `code` evaluation
# genre (top-level modules) do not read: the held-out source code.
HELD_OUT_CODE_PACKAGES = ("unittest", "logging", "importlib", "concurrent")
_CODE_CHARS = 120_000
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


@torch.no_grad()
def measure(session, config: InfiniGenConfig, progress: bool = True) -> SpreadChoice:
    """Teacher-force each spread of `config` on the held-out windows through `session` (an
    attached session of the model) and keep the one with the smaller KL as a multiple of the
    oracle's. A window where the oracle's KL is zero compares the spreads' KL (+1 each, so that
    the ratio stays defined)."""
    adapter = session.adapter
    length = min(CONTEXT, calibration_length(config.calibration_tokens, adapter), adapter.max_positions)
    scored = min(SCORED, max(length // 4, 1))
    windows = held_out_ids(session.tokenizer, session.model.config.vocab_size, length)
    candidates = {name: config.replace(allocation=name) for name in SPREADS}
    oracle = config.replace(policy="oracle", budget=config.resolved_budget)
    total = len(windows) * (2 + len(candidates))
    bar = tqdm(total=total, desc="choosing the budget spread", unit="run", disable=not progress, leave=False)
    ratios: dict[str, list[float]] = {name: [] for name in candidates}
    ev = ForcedRunner(session.model, session)
    for ids in windows:
        t0 = ids.shape[0] - scored
        prefix = ev.prefill(ids[:t0][None])
        chunk = ids[t0:][None]
        dense = ev.run(prefix, chunk, InfiniGenConfig(policy="dense")).logits[0]
        bar.update(1)
        base = kl_divergence(dense, ev.run(prefix, chunk, oracle).logits[0])
        bar.update(1)
        for name, cfg in candidates.items():
            kl = kl_divergence(dense, ev.run(prefix, chunk, cfg).logits[0])
            ratios[name].append(kl / base if base > 0 else 1.0 + kl)
            bar.update(1)
    bar.close()
    mean = {name: sum(v) / len(v) for name, v in ratios.items()}
    best = min(SPREADS, key=mean.__getitem__)  # the first of equals: uniform
    if any(math.isnan(v) for v in mean.values()):
        best = SPREADS[0]
    return SpreadChoice(best, mean, length, scored, len(windows))
