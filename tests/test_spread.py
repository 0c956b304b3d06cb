"""allocation "auto" and the unset correction target: chosen per model by a measurement, stored in
the skew artifact under its settings, and used exactly as the explicit settings they name."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from conftest import tiny_model
from infinigen import ConfigError, InfiniGenConfig, SkewArtifact, attach
from infinigen.config import SpeculationKnobs
from infinigen.eval.evaluator import Evaluator
from infinigen.eval.metrics import kl_divergence
from infinigen.eval.spread_choice import SCORED, held_out_ids
from infinigen.models import get_adapter
from infinigen.select import make_selector
from infinigen.skew import calibrate, synthetic_calibration_ids
from infinigen.spread import (
    SPREADS,
    TARGETS,
    SpreadChoice,
    choose_target,
    needs_measuring,
    resolve_measured,
    settings_key,
    stored_choice,
)

BASE = dict(budget=0.25, calibration_tokens=128)


def test_the_default_is_auto_and_its_key_follows_the_settings_it_depends_on():
    cfg = InfiniGenConfig(**BASE)
    assert InfiniGenConfig().allocation == "auto"
    with pytest.raises(ConfigError, match="channel_allocation"):
        InfiniGenConfig(channel_allocation="auto")  # only the budget's spread is measured
    assert InfiniGenConfig().correction_target is None  # chosen with it
    assert settings_key(cfg) == settings_key(cfg.replace(kv_dtype="float16"))  # rounding, not positions
    changes = (
        dict(budget=0.1),
        dict(correction=0.02),
        dict(speculate_from="previous"),
        dict(dense_layers=1),
        dict(allocation="calibrated"),  # an explicit spread's target is measured apart
        dict(correction_target=1.25),
    )
    for change in changes:
        assert settings_key(cfg) != settings_key(cfg.replace(**change)), change


def test_what_needs_measuring():
    cfg = InfiniGenConfig(**BASE)
    assert needs_measuring(cfg)
    assert needs_measuring(cfg.replace(allocation="uniform"))  # the target is still left
    assert needs_measuring(cfg.replace(correction_target=1.5))  # the spread is still left
    assert not needs_measuring(cfg.replace(allocation="uniform", correction_target=1.5))
    assert not needs_measuring(cfg.replace(allocation="uniform", correction=0.02))  # no target to choose
    assert not needs_measuring(cfg.replace(allocation="uniform", speculate_from="own"))  # nothing to correct
    assert not needs_measuring(cfg.replace(budget=1.0))
    assert not needs_measuring(cfg.replace(policy="oracle"))


def test_the_target_is_the_least_correction_within_the_aim(monkeypatch):
    monkeypatch.setattr(sys.modules["infinigen.spread"], "KL_AIM", 1.2)
    assert choose_target({1.5: 1.1}) == 1.5
    assert choose_target({1.5: 1.3, 1.25: 1.19, 1.1: 1.0}) == 1.25  # the first within, not the least
    assert choose_target({1.5: 1.4, 1.25: 1.3, 1.1: 1.25}) == 1.1  # none within: the least KL
    assert choose_target({1.5: 1.4, 1.25: 1.3, 1.1: 1.3}) == 1.25  # equals: the least correction
    assert choose_target({1.5: 1.4, 1.25: float("nan"), 1.1: 1.5}) == 1.5


def test_auto_is_measured_once_stored_in_the_cached_artifact_and_equals_the_spread_it_names(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    cfg = InfiniGenConfig(**BASE)
    with attach(model, cfg, progress=False) as session:
        auto = session.selector_for(cfg)
        choice = stored_choice(session.artifact, cfg)
        assert choice is not None and choice.choice in SPREADS and set(choice.kl_ratio) == set(SPREADS)
        assert choice.choice == min(SPREADS, key=lambda s: (choice.kl_ratio[s], SPREADS.index(s)))
        assert choice.correction_target in TARGETS and str(TARGETS[0]) in choice.target_kl_ratio
        named = session.selector_for(cfg.replace(allocation=choice.choice, correction_target=choice.correction_target))
        assert auto.knobs.allocation == choice.choice and auto.knobs.correction_target == choice.correction_target
        assert auto.layer_budgets == named.layer_budgets and auto.layer_corrections == named.layer_corrections
        assert auto.describe()["allocation_chosen_by"]["kl_ratio"] == {
            k: round(v, 4) for k, v in choice.kl_ratio.items()
        }
    (path,) = (tmp_path / "skew").glob("*.safetensors")
    assert stored_choice(SkewArtifact.load(path), cfg) == choice  # saved with the cached artifact

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(sys.modules["infinigen.attach"], "measure_spread", must_not_measure)
    with attach(model, cfg, progress=False) as session:
        assert session.selector_for(cfg).knobs.allocation == choice.choice
        session.selector_for(cfg.replace(allocation="uniform", correction_target=1.25))  # nothing left to measure
    with attach(model, cfg, progress=False) as session, pytest.raises(AssertionError, match="measured again"):
        session.selector_for(cfg.replace(budget=0.5))  # other settings: a measurement of their own


def _evaluator_ratios(model, choice: SpreadChoice, cfg: InfiniGenConfig, configs: dict) -> dict:
    """Per config (key -> config), KL(dense, config) / KL(dense, oracle at cfg's budget) computed
    by the evaluator on the measurement's held-out window: the independent reference."""
    (ids,) = held_out_ids(None, model.config.vocab_size, choice.context)
    t0 = ids.shape[0] - choice.scored
    with Evaluator(model) as ev:
        prefix = ev.prefill(ids[:t0][None])
        chunk = ids[t0:][None]
        dense = ev.run(prefix, chunk, InfiniGenConfig(policy="dense")).logits[0]
        oracle = kl_divergence(dense, ev.run(prefix, chunk, cfg.replace(policy="oracle")).logits[0])
        assert oracle > 0
        return {key: kl_divergence(dense, ev.run(prefix, chunk, c).logits[0]) / oracle for key, c in configs.items()}


def test_the_measurement_is_the_kl_of_each_spread_over_the_oracles(monkeypatch, tmp_path):
    """The stored ratios equal KL(dense, spread) / KL(dense, oracle) computed by the evaluator on
    the same held-out window."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("qwen2")
    cfg = InfiniGenConfig(**BASE)
    with attach(model, cfg, progress=False) as session:
        session.selector_for(cfg)
        choice = stored_choice(session.artifact, cfg)
    assert (choice.context, choice.windows) == (128, 1)
    assert choice.scored == min(SCORED, choice.context // 4)
    explicit = {
        name: cfg.replace(allocation=name, correction_target=TARGETS[0]) for name in SPREADS
    }  # least correction
    for name, ratio in _evaluator_ratios(model, choice, cfg, explicit).items():
        assert choice.kl_ratio[name] == pytest.approx(ratio, rel=1e-4)


@pytest.mark.parametrize("aim", [0.0, math.inf])
def test_stricter_targets_are_run_only_where_the_least_correction_misses_the_aim(monkeypatch, tmp_path, aim):
    """With an aim nothing meets, every target is measured (each equal to the evaluator's KL
    ratio, targets of equal top-ups run once, on the window's one prefill) and the least KL kept;
    with an aim everything meets, only the least correction runs."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sys.modules["infinigen.eval.spread_choice"], "KL_AIM", aim)
    monkeypatch.setattr(sys.modules["infinigen.spread"], "KL_AIM", aim)
    model = tiny_model("llama")
    cfg = InfiniGenConfig(**BASE, allocation="uniform")
    runs = []
    runner = sys.modules["infinigen.eval.spread_choice"].ForcedRunner
    original = runner.run
    monkeypatch.setattr(runner, "run", lambda self, *a, **k: runs.append(a[-1]) or original(self, *a, **k))
    prefills, prefill = [], runner.prefill
    monkeypatch.setattr(runner, "prefill", lambda self, ids: prefills.append(ids) or prefill(self, ids))
    with attach(model, cfg, progress=False) as session:
        session.selector_for(cfg)
        choice = stored_choice(session.artifact, cfg)
        top_ups = {
            t: tuple(session.selector_for(cfg.replace(correction_target=t)).layer_corrections.items()) for t in TARGETS
        }
    assert choice.choice == "uniform" and set(choice.kl_ratio) == {"uniform"}
    if aim == math.inf:
        assert choice.correction_target == TARGETS[0] and list(choice.target_kl_ratio) == [f"{TARGETS[0]:g}"]
        assert len(runs) == 3  # dense, oracle, the least correction
        return
    assert set(choice.target_kl_ratio) == {f"{t:g}" for t in TARGETS}
    ratios = {t: choice.target_kl_ratio[f"{t:g}"] for t in TARGETS}
    assert choice.correction_target == min(TARGETS, key=lambda t: (ratios[t], TARGETS.index(t)))
    assert len(runs) == 2 + len(set(top_ups.values()))  # equal top-ups: one run
    assert len(set(top_ups.values())) > 1, "the tiny model must need a stricter target for this test"
    assert len(prefills) == 1  # the window's prefill is kept for the stricter targets
    explicit = {t: cfg.replace(correction_target=t) for t in TARGETS}
    for t, ratio in _evaluator_ratios(model, choice, cfg, explicit).items():
        assert ratios[t] == pytest.approx(ratio, rel=1e-4)


def test_a_given_artifact_file_is_never_rewritten(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model("llama")
    cfg = InfiniGenConfig(**BASE)
    with attach(model, cfg.replace(allocation="uniform"), progress=False) as session:
        art = session.artifact
    given = tmp_path / "given.safetensors"
    art.save(given)
    before = given.read_bytes()
    with attach(model, cfg, skew=given, progress=False) as session:
        assert session.selector_for(cfg).knobs.allocation in SPREADS
        assert stored_choice(session.artifact, cfg) is not None  # in memory
    assert given.read_bytes() == before


def test_auto_without_a_measurement_says_how_to_get_one_and_a_whole_budget_needs_none():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    art = calibrate(model, adapter, synthetic_calibration_ids(96, 64), 0.75, True, progress=False)
    with pytest.raises(ValueError, match="allocation 'auto'.*attach the model.*uniform, calibrated.*correction_target"):
        make_selector(InfiniGenConfig(budget=0.25), adapter, art)
    whole = InfiniGenConfig(budget=1.0)
    resolved = resolve_measured(whole.knobs(SpeculationKnobs), art, whole)
    assert (resolved.allocation, resolved.correction_target) == ("uniform", TARGETS[0])
    art.meta[settings_key(InfiniGenConfig(budget=0.25))] = SpreadChoice(
        "calibrated", {"uniform": 2.0, "calibrated": 1.0}, 64, 16, 1, 1.25, {"1.5": 1.3, "1.25": 1.1}
    ).to_json()
    knobs = make_selector(InfiniGenConfig(budget=0.25), adapter, art).knobs
    assert (knobs.allocation, knobs.correction_target) == ("calibrated", 1.25)
    art.meta[settings_key(InfiniGenConfig(budget=0.25))] = "not json"
    assert stored_choice(art, InfiniGenConfig(budget=0.25)) is None  # unreadable: measured again


def test_the_skew_command_stores_the_defaults_spread(tmp_path, tiny_model_dir, capsys):
    from infinigen.cli import main

    out_file = tmp_path / "a.safetensors"
    args = ["skew", "--model", str(tiny_model_dir), "--quiet", "--calibration-tokens", "64", "--output", str(out_file)]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    line = [x for x in out if x.startswith("budget spread")]
    choice = stored_choice(SkewArtifact.load(out_file), InfiniGenConfig(calibration_tokens=64, kv_dtype="float16"))
    assert choice is not None and line and f": {choice.choice};" in line[0] and "2 windows of 64 tokens" in line[0]
    assert torch.isfinite(torch.tensor(list(choice.kl_ratio.values()))).all()
    target = [x for x in out if x.startswith("correction target")]
    assert choice.correction_target in TARGETS and target and f": {choice.correction_target:g};" in target[0]
