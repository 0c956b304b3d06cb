"""Calibration decides, the runtime reads: the budget's spread and the correction target are
measured once per artifact by the calibration step (on held-out text, against dense and the
oracle), stored as concrete values, and read for every budget and setting; a second process waits
for the first one's calibration instead of repeating it."""

from __future__ import annotations

import fcntl
import math
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from conftest import tiny_model
from infinigen import InfiniGenConfig, SkewArtifact, attach
from infinigen.calibration import Calibrator, reference_config
from infinigen.eval.evaluator import Evaluator
from infinigen.measure.metrics import kl_divergence
from infinigen.measure.spread_choice import SCORED, held_out_ids
from infinigen.models import get_adapter
from infinigen.select import NotCalibratedError, make_selector, reads_choice, resolve_measured
from infinigen.skew import SkewArtifactError, cached_path, calibrate, model_fingerprint, synthetic_calibration_ids
from infinigen.skew.choice import (
    CORRECTION_TARGETS,
    REFERENCE_BUDGET,
    SPREADS,
    MeasuredChoice,
    choose_target,
    store_choice,
    stored_choice,
)

BASE = dict(budget=0.25, calibration_tokens=128)


def _no_measuring(monkeypatch):
    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(sys.modules["infinigen.calibration"], "measure", must_not_measure)


def test_what_reads_the_choice():
    cfg = InfiniGenConfig(**BASE)
    assert InfiniGenConfig().allocation == "auto" and InfiniGenConfig().correction_target is None
    assert reads_choice(cfg)
    assert reads_choice(cfg.replace(allocation="uniform"))  # the target is still left
    assert reads_choice(cfg.replace(correction_target=1.5))  # the spread is still left
    assert not reads_choice(cfg.replace(allocation="uniform", correction_target=1.5))
    assert not reads_choice(cfg.replace(allocation="uniform", correction=0.02))  # no target to choose
    assert not reads_choice(cfg.replace(allocation="uniform", speculate_from="own"))  # nothing to correct
    assert not reads_choice(cfg.replace(budget=1.0))
    assert not reads_choice(cfg.replace(policy="oracle"))
    ref = reference_config(cfg.replace(alpha=3.0, aggregation="max", budget=0.05, partial_ratio=0.5))
    assert ref == InfiniGenConfig(budget=REFERENCE_BUDGET, partial_ratio=0.5, calibration_tokens=128)


def test_the_target_is_the_least_correction_within_the_aim(monkeypatch):
    monkeypatch.setattr(sys.modules["infinigen.skew.choice"], "KL_AIM", 1.2)
    assert choose_target({1.5: 1.1}) == 1.5
    assert choose_target({1.5: 1.3, 1.25: 1.19, 1.1: 1.0}) == 1.25  # the first within, not the least
    assert choose_target({1.5: 1.4, 1.25: 1.3, 1.1: 1.25}) == 1.1  # none within: the least KL
    assert choose_target({1.5: 1.4, 1.25: 1.3, 1.1: 1.3}) == 1.25  # equals: the least correction
    assert choose_target({1.5: 1.4, 1.25: float("nan"), 1.1: 1.5}) == 1.5


def test_calibration_stores_the_choice_once_and_every_budget_reads_it(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    cfg = InfiniGenConfig(**BASE)
    with attach(model, cfg, progress=False) as session:
        choice = stored_choice(session.artifact)  # measured by attach, before any selector is asked for
        assert choice is not None and choice.allocation in SPREADS and set(choice.kl_ratio) == set(SPREADS)
        assert choice.allocation == min(SPREADS, key=lambda s: (choice.kl_ratio[s], SPREADS.index(s)))
        assert choice.correction_target in CORRECTION_TARGETS and choice.budget == REFERENCE_BUDGET
        auto = session.selector_for(cfg)
        named = session.selector_for(
            cfg.replace(allocation=choice.allocation, correction_target=choice.correction_target)
        )
        assert (auto.knobs.allocation, auto.knobs.correction_target) == (choice.allocation, choice.correction_target)
        assert auto.layer_budgets == named.layer_budgets and auto.layer_corrections == named.layer_corrections
        assert auto.describe()["chosen_by_calibration"]["kl_ratio_by_spread"] == {
            k: round(v, 4) for k, v in choice.kl_ratio.items()
        }
    (path,) = (tmp_path / "skew").glob("*.safetensors")
    assert stored_choice(SkewArtifact.load(path)) == choice  # saved with the cached artifact

    _no_measuring(monkeypatch)
    for budget in (0.05, 0.1, 0.5):  # every budget and setting reads the one measurement
        with attach(model, cfg.replace(budget=budget), progress=False) as session:
            for other in (cfg.replace(budget=budget), cfg.replace(budget=budget, aggregation="max", alpha=4.0)):
                knobs = session.selector_for(other).knobs
                assert (knobs.allocation, knobs.correction_target) == (choice.allocation, choice.correction_target)
            explicit = session.selector_for(cfg.replace(allocation="uniform", correction_target=1.25)).knobs
            assert (explicit.allocation, explicit.correction_target) == ("uniform", 1.25)


def _evaluator_ratios(model, choice: MeasuredChoice, cfg: InfiniGenConfig, configs: dict) -> dict:
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
    """The stored ratios equal KL(dense, spread) / KL(dense, oracle) at the reference budget,
    computed by the evaluator on the same held-out window."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("qwen2")
    cfg = InfiniGenConfig(**BASE)
    with attach(model, cfg, progress=False) as session:
        choice = stored_choice(session.artifact)
    assert (choice.context, choice.windows) == (128, 1)
    assert choice.scored == min(SCORED, choice.context // 4)
    ref = reference_config(cfg)
    explicit = {name: ref.replace(allocation=name, correction_target=CORRECTION_TARGETS[0]) for name in SPREADS}
    for name, ratio in _evaluator_ratios(model, choice, ref, explicit).items():
        assert choice.kl_ratio[name] == pytest.approx(ratio, rel=1e-4)


@pytest.mark.parametrize("aim", [0.0, math.inf])
def test_stricter_targets_are_run_only_where_the_least_correction_misses_the_aim(monkeypatch, tmp_path, aim):
    """With an aim nothing meets, every target is measured (each equal to the evaluator's KL
    ratio, targets of equal top-ups run once, on the window's one prefill) and the least KL kept;
    with an aim everything meets, only the least correction runs."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sys.modules["infinigen.measure.spread_choice"], "KL_AIM", aim)
    monkeypatch.setattr(sys.modules["infinigen.skew.choice"], "KL_AIM", aim)
    model = tiny_model("llama")
    cfg = InfiniGenConfig(**BASE)
    runs = []
    runner = sys.modules["infinigen.measure.spread_choice"].ForcedRunner
    original = runner.run
    monkeypatch.setattr(runner, "run", lambda self, *a, **k: runs.append(a[-1]) or original(self, *a, **k))
    prefills, prefill = [], runner.prefill
    monkeypatch.setattr(runner, "prefill", lambda self, ids: prefills.append(ids) or prefill(self, ids))
    with attach(model, cfg, progress=False) as session:
        choice = stored_choice(session.artifact)
        ref = reference_config(cfg).replace(allocation=choice.allocation)
        top_ups = {
            t: tuple(session.selector_for(ref.replace(correction_target=t)).layer_corrections.items())
            for t in CORRECTION_TARGETS
        }
    if aim == math.inf:
        assert choice.correction_target == CORRECTION_TARGETS[0]
        assert list(choice.target_kl_ratio) == [f"{CORRECTION_TARGETS[0]:g}"]
        assert len(runs) == 2 + len(SPREADS)  # dense, oracle, each spread at the least correction
        return
    assert set(choice.target_kl_ratio) == {f"{t:g}" for t in CORRECTION_TARGETS}
    ratios = {t: choice.target_kl_ratio[f"{t:g}"] for t in CORRECTION_TARGETS}
    assert choice.correction_target == min(CORRECTION_TARGETS, key=lambda t: (ratios[t], CORRECTION_TARGETS.index(t)))
    assert len(runs) == 2 + len(SPREADS) + len(set(top_ups.values())) - 1  # equal top-ups: one run
    assert len(set(top_ups.values())) > 1, "the tiny model must need a stricter target for this test"
    assert len(prefills) == 1  # the window's prefill is kept for the stricter targets
    explicit = {t: ref.replace(correction_target=t) for t in CORRECTION_TARGETS}
    for t, ratio in _evaluator_ratios(model, choice, ref, explicit).items():
        assert ratios[t] == pytest.approx(ratio, rel=1e-4)


def test_a_given_artifact_file_is_never_rewritten(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model("llama")
    adapter = get_adapter(model)
    cfg = InfiniGenConfig(**BASE)
    art = calibrate(
        model, adapter, synthetic_calibration_ids(96, 128), InfiniGenConfig().partial_ratio, True, progress=False
    )
    given = tmp_path / "given.safetensors"
    art.save(given)
    before = given.read_bytes()
    with attach(model, cfg, skew=given, progress=False) as session:
        assert session.selector_for(cfg).knobs.allocation in SPREADS
        assert stored_choice(session.artifact) is not None  # measured, in memory
    assert given.read_bytes() == before
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing cached either


def test_without_a_measurement_the_selector_says_how_to_get_one_and_a_whole_budget_needs_none():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    art = calibrate(
        model, adapter, synthetic_calibration_ids(96, 64), InfiniGenConfig().partial_ratio, True, progress=False
    )
    with pytest.raises(NotCalibratedError, match="infinigen skew.*infinigen.attach.*uniform, calibrated"):
        make_selector(InfiniGenConfig(budget=0.25), adapter, art)
    whole = InfiniGenConfig(budget=1.0)
    resolved = resolve_measured(whole.knobs(type(make_selector(whole, adapter, art).knobs)), art, whole)
    assert (resolved.allocation, resolved.correction_target) == ("uniform", CORRECTION_TARGETS[0])
    measured = dict(kl_ratio={"uniform": 2.0, "calibrated": 1.0}, target_kl_ratio={"1.5": 1.3}, context=64, scored=16)
    # measured with the partial keys kept otherwise than today's reference (or not recorded): measured again
    for stale in ("", "int8" if InfiniGenConfig.partial_format != "int8" else "int4"):
        store_choice(art, MeasuredChoice("calibrated", 1.25, **measured, windows=1, partial_format=stale))
        assert stored_choice(art) is not None
        with pytest.raises(NotCalibratedError):
            make_selector(InfiniGenConfig(budget=0.25), adapter, art)
    current = MeasuredChoice("calibrated", 1.25, **measured, windows=1, partial_format=InfiniGenConfig.partial_format)
    store_choice(art, current)
    for budget in (0.05, 0.25):
        knobs = make_selector(InfiniGenConfig(budget=budget), adapter, art).knobs
        assert (knobs.allocation, knobs.correction_target) == ("calibrated", 1.25)
    art.meta["measured_choice"] = "not json"
    assert stored_choice(art) is None  # unreadable: measured again


def test_a_second_caller_waits_for_the_first_ones_calibration(monkeypatch, tmp_path):
    """While the artifact's lock is held (by another process: here, another open file), attach
    waits, then reads what the holder stored, measuring nothing itself."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    cfg = InfiniGenConfig(**BASE)
    with attach(model, cfg, progress=False):
        pass
    _no_measuring(monkeypatch)
    artifact = Calibrator(model).path(cfg)
    lock = tmp_path / "locks" / f"{artifact.stem}.lock"
    assert lock.is_file()
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    done = threading.Event()

    def second():
        with attach(model, cfg, progress=False):
            done.set()

    thread = threading.Thread(target=second)
    thread.start()
    try:
        assert not done.wait(1.0), "attach did not wait for the calibration in progress"
    finally:
        os.close(fd)
    thread.join(60)
    assert done.is_set()


def test_two_processes_on_an_empty_cache_calibrate_once(tmp_path, tiny_model_dir):
    env = {**os.environ, "INFINIGEN_CACHE_DIR": str(tmp_path)}
    code = "import sys; from infinigen.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hello", "--max-new-tokens", "2"]
    args += ["--calibration-tokens", "512"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    said = [err for _, err in outs]
    assert sum("first use of this model" in err for err in said) == 1, said
    assert sum("measuring the budget's spread" in err for err in said) == 1, said
    assert len(list((tmp_path / "skew").glob("*.safetensors"))) == 1


def test_the_skew_command_stores_the_choice(tmp_path, tiny_model_dir, capsys):
    from infinigen.cli import main

    out_file = tmp_path / "a.safetensors"
    args = ["skew", "--model", str(tiny_model_dir), "--quiet", "--calibration-tokens", "64", "--output", str(out_file)]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    choice = stored_choice(SkewArtifact.load(out_file))
    assert choice is not None and choice.budget == REFERENCE_BUDGET
    line = [x for x in out if x.startswith("budget spread")]
    assert line and f": {choice.allocation};" in line[0] and "2 windows of 64 tokens" in line[0]
    assert torch.isfinite(torch.tensor(list(choice.kl_ratio.values()))).all()
    target = [x for x in out if x.startswith("correction target")]
    assert target and f": {choice.correction_target:g};" in target[0]


def test_the_first_use_says_what_it_does_how_long_it_takes_and_where_it_keeps_it(monkeypatch, tmp_path, capsys):
    """One line before the work starts, with an estimate timed on this machine; none afterwards."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    cfg = InfiniGenConfig(**BASE)
    with attach(model, cfg):
        pass
    said = [line for line in capsys.readouterr().err.splitlines() if "first use of this model" in line]
    assert len(said) == 1
    assert "calibrating it once" in said[0] and "128 tokens" in said[0] and "measuring" in said[0]
    assert re.search(r"about \d+ (s|minutes) on this machine", said[0]), said[0]
    assert str(tmp_path / "skew") in said[0]
    with attach(model, cfg):
        pass
    assert "first use" not in capsys.readouterr().err


def test_an_artifact_cached_by_an_earlier_version_is_adopted_not_recalibrated(monkeypatch, tmp_path):
    """Earlier versions keyed an artifact by the weights' exact bytes: the first attach after an
    upgrade finds the model's own under that key, and saves it where today's fingerprint looks;
    a given file of that kind serves as it is. Another model's stays refused."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    cfg = InfiniGenConfig(**BASE)
    with attach(model, cfg, progress=False):
        pass
    (today,) = (tmp_path / "skew").glob("*.safetensors")
    old = SkewArtifact.load(today)
    old.fingerprint = model_fingerprint(model, exact=True)
    earlier = cached_path(model, get_adapter(model), old.fingerprint, cfg)
    old.save(earlier)  # as an earlier version left it
    today.unlink()

    _no_measuring(monkeypatch)
    calibration = sys.modules["infinigen.calibration"]
    monkeypatch.setattr(calibration, "calibrate_skew", lambda *a, **k: pytest.fail("recalibrated"))
    with attach(model, cfg, progress=False) as session:
        assert session.artifact.fingerprint == model_fingerprint(model)
    assert SkewArtifact.load(today).fingerprint == model_fingerprint(model)
    with attach(model, cfg, skew=earlier, progress=False) as session:
        assert session.artifact.fingerprint == model_fingerprint(model)
    with pytest.raises(SkewArtifactError, match="another model"):
        with attach(tiny_model("llama", seed=4), cfg, skew=earlier, progress=False):
            pass
