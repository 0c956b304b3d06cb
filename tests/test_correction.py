"""The correction chosen per layer from calibration (knob `correction` None): the table that
calibration measures, the rule that reads it, the artifact that carries it, and the selector
that applies it."""

import math

import pytest
import torch

from conftest import VOCAB, tiny_model, tiny_variant
from infinigen import InfiniGenConfig, SkewArtifact, SkewArtifactError, attach
from infinigen.compat import cache_kwargs
from infinigen.models import get_adapter
from infinigen.select import make_selector
from infinigen.skew import SkewArtifactWarning, calibrate, synthetic_calibration_ids
from infinigen.skew.choice import CORRECTION_TARGETS
from infinigen.skew.tables import correction_error_table, correction_share
from infinigen.speculate import (
    aggregate_group,
    all_valid,
    partial_projection,
    partial_scores,
    select_positions,
    selection_mask,
    top_up,
)


def _heads(seed: int, t: int = 90, h: int = 4, hkv: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(h, t, d, generator=g) * 2
    k = torch.randn(hkv, t, d, generator=g) * 2
    v = torch.randn(hkv, t, d, generator=g)
    skew = torch.linalg.qr(torch.randn(hkv, d, d, generator=g)).Q
    channels = torch.stack([torch.randperm(d, generator=g)[:5].sort().values for _ in range(hkv)])
    return q, k, v, partial_projection(skew, channels, d)


def _reference_error(q, spec, k, v, proj, p, budget, share, scaling):
    """One position through the runtime's own rules: `select_positions` on the speculated
    query's partial scores, `top_up` with the own query's, then attention over the selection
    and the position itself, against dense attention."""
    hkv = k.shape[0]
    valid = all_valid(1, hkv, p)

    def group(query):
        q_part = torch.einsum("hd,hdc->hc", query, proj.repeat_interleave(query.shape[0] // hkv, 0))
        s = partial_scores(q_part[None], k[None, :, :p] @ proj[None], scaling)
        return aggregate_group(s, valid, hkv, "mass")

    sel = select_positions(group(spec), valid, math.inf, budget * (1 - share), None, 1)
    chosen = selection_mask(sel, p)
    count = torch.full((1, hkv), math.ceil(p * budget * share))
    extra = top_up(group(q), valid, chosen, count)
    chosen = chosen | selection_mask(extra, p)
    logits = torch.einsum("hd,htd->ht", q, k[:, : p + 1].repeat_interleave(q.shape[0] // hkv, 0)) * scaling
    keep = torch.cat([chosen[0], torch.ones(hkv, 1, dtype=torch.bool)], 1).repeat_interleave(q.shape[0] // hkv, 0)
    vv = v[:, : p + 1].repeat_interleave(q.shape[0] // hkv, 0)
    dense = torch.einsum("ht,htd->hd", logits.softmax(-1), vv)
    kept = torch.einsum("ht,htd->hd", logits.masked_fill(~keep, -math.inf).softmax(-1), vv)
    return float((kept - dense).pow(2).sum(-1).mean())


@pytest.mark.parametrize("seed", range(3))
def test_the_table_is_the_runtime_selection_scored_by_its_output_error(seed):
    q, k, v, proj = _heads(seed)
    g = torch.Generator().manual_seed(100 + seed)
    positions = torch.tensor([40, 63, 89])
    spec = q[:, positions] + torch.randn(q.shape[0], len(positions), q.shape[-1], generator=g)
    budgets, shares = (0.1, 0.25), (0.0, 0.25, 0.5)
    errors, _ = correction_error_table(q, spec, k, v, positions, 0.3, proj, budgets, shares)
    for a, b in enumerate(budgets):
        for z, s in enumerate(shares):
            want = sum(
                _reference_error(q[:, p], spec[:, j], k, v, proj, p, b, s, 0.3)
                for j, p in enumerate(positions.tolist())
            ) / len(positions)
            assert errors[a, z].item() == pytest.approx(want, rel=1e-4, abs=1e-7), (b, s)


def test_the_table_is_zero_where_everything_is_kept_and_the_oracle_beats_a_blind_speculation():
    q, k, v, proj = _heads(7)
    positions = torch.tensor([50, 70, 89])
    blind = torch.zeros(q.shape[0], len(positions), q.shape[-1])  # scores every position alike
    errors, oracle = correction_error_table(q, blind, k, v, positions, 0.3, proj, (0.1, 1.0), (0.0, 0.5))
    assert errors[1].abs().max() < 1e-10 and oracle[1].abs() < 1e-10  # all kept: the dense output
    assert oracle[0] < errors[0, 0]  # at 10% the true top beats the first positions
    assert errors[0, 1] < errors[0, 0]  # and the own query's top-up recovers part of it


def _table(values):
    """A layer's table over the budgets (0.05, 0.1, 0.2) and shares (0, .25, .5): the same row at each budget."""
    return torch.tensor([values] * 3, dtype=torch.float32)


GRID = ((0.05, 0.1, 0.2), (0.0, 0.25, 0.5))


@pytest.mark.parametrize(
    "row, want",
    [
        ([1.4, 1.0, 0.9], 0.0),  # within 1.5x the oracle: left alone, though a top-up would help
        ([3.0, 1.4, 0.9], 0.25),  # the least share that brings it within
        ([3.0, 2.0, 1.5], 0.5),
        ([3.0, 2.5, 2.0], 0.5),  # none does: the least error
        ([3.0, 2.0, 2.0], 0.25),  # equal errors: the smaller share
    ],
)
def test_the_share_is_the_least_top_up_within_the_target(row, want):
    oracle = torch.ones(3)
    assert CORRECTION_TARGETS[0] == 1.5  # the default target: the least correction
    assert correction_share(_table(row), oracle, 0.1, *GRID) == want


def test_the_share_is_read_at_the_budget_in_log_budget_and_clamped():
    oracle = torch.ones(3)
    table = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [2.0, 1.0, 1.0]])  # only at 20% a miss
    assert correction_share(table, oracle, 0.2, *GRID) == 0.25
    assert correction_share(table, oracle, 0.9, *GRID) == 0.25  # past the grid: its last budget
    assert correction_share(table, oracle, 0.1, *GRID) == 0.0
    # halfway in log budget between 10% and 20%: error 1.5, exactly at the target
    assert correction_share(table, oracle, math.sqrt(0.1 * 0.2), *GRID) == 0.0
    assert correction_share(table, oracle, 0.15, *GRID) == 0.25
    assert correction_share(table, oracle, 1.0, *GRID) == 0.0  # everything fetched: nothing to correct


def test_calibration_measures_a_table_for_each_global_layer_but_the_first(tmp_path):
    model = tiny_variant("gemma3")
    adapter = get_adapter(model)
    art = calibrate(
        model, adapter, synthetic_calibration_ids(VOCAB, 64), InfiniGenConfig().partial_ratio, True, progress=False
    )
    globals_ = [i for i in range(1, adapter.num_layers) if not adapter.is_local(i)]
    assert globals_ and sorted(art.correction_errors) == sorted(art.oracle_errors) == globals_
    budgets, shares = len(art.correction_budgets), len(art.correction_shares)
    for i in globals_:
        assert art.correction_errors[i].shape == (2, budgets, shares)  # previous, fitted
        assert (art.correction_errors[i] >= 0).all() and (art.oracle_errors[i] >= 0).all()
    art.save(tmp_path / "a.safetensors")
    back = SkewArtifact.load(tmp_path / "a.safetensors")
    assert back.has_correction_tables()
    for i in globals_:
        torch.testing.assert_close(back.correction_errors[i], art.correction_errors[i])
        torch.testing.assert_close(back.oracle_errors[i], art.oracle_errors[i])
    torch.testing.assert_close(back.correction_shares, art.correction_shares)


def _rigged(art: SkewArtifact, row: list[float], layers: list[int]) -> SkewArtifact:
    """`art` with every listed layer's table set to `row` (errors relative to an oracle of 1)."""
    n_b, n_s = len(art.correction_budgets), len(art.correction_shares)
    errors = {i: torch.tensor(row).expand(2, n_b, n_s).clone() for i in layers}
    return SkewArtifact(
        **{**vars(art), "correction_errors": errors, "oracle_errors": {i: torch.ones(n_b) for i in layers}}
    )


def test_the_chosen_correction_decodes_as_the_same_split_set_by_hand(tmp_path):
    """A layer whose table asks for half its budget as a top-up decodes exactly as the explicit
    knobs with that split do (budget 25%: 12.5% speculated, 12.5% corrected), and one whose
    speculation is within the target is left alone."""
    model = tiny_model("llama")
    adapter = get_adapter(model)
    art = calibrate(
        model, adapter, synthetic_calibration_ids(VOCAB, 64), InfiniGenConfig().partial_ratio, True, progress=False
    )
    n_s = len(art.correction_shares)
    assert art.correction_shares.tolist()[-1] == 0.5
    row = [10.0] * (n_s - 1) + [1.0]  # only half the budget as a top-up brings it within
    _rigged(art, row, [2, 3]).save(tmp_path / "rigged.safetensors")
    ids = torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    base = dict(budget=0.25, allocation="uniform", correction_target=1.5, calibration_tokens=64)
    runs = []
    for cfg in (InfiniGenConfig(**base), InfiniGenConfig(**{**base, "budget": 0.125}, correction=0.125)):
        with attach(model, cfg, skew=tmp_path / "rigged.safetensors", progress=False) as session:
            with session.new_cache() as cache:
                out = model.generate(
                    input_ids=ids, **cache_kwargs(model, cache), max_new_tokens=6, do_sample=False,
                    output_logits=True, return_dict_in_generate=True,
                )  # fmt: skip
                runs.append((out.sequences, torch.stack(out.logits), cache.summary()))
    (seq_a, logits_a, sum_a), (seq_b, logits_b, sum_b) = runs
    assert torch.equal(seq_a, seq_b)
    torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=0)
    assert sum_a["correction_bytes"] == sum_b["correction_bytes"] > 0
    selector = make_selector(InfiniGenConfig(**base), adapter, _rigged(art, row, [2, 3]))
    assert selector.describe()["layer_corrections"] == {"2": 0.125, "3": 0.125}
    assert selector.budget(2) == 0.25 and selector.speculated_budget(2) == selector.correction(2) == 0.125
    per_layer = {p["layer"]: p for p in sum_a["per_layer"]}
    assert per_layer[2]["budget"] == 0.25 and per_layer[2]["correction"] == 0.125  # what summary() reports
    calm = make_selector(InfiniGenConfig(**base), adapter, _rigged(art, [1.2] + [1.0] * (n_s - 1), [2, 3]))
    assert not calm.layer_corrections and calm.speculated_budget(2) == 0.25 and calm.correction(2) == 0.0


def test_a_number_or_own_speculation_overrides_the_tables():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    art = calibrate(
        model, adapter, synthetic_calibration_ids(VOCAB, 64), InfiniGenConfig().partial_ratio, True, progress=False
    )
    rigged = _rigged(art, [10.0] * (len(art.correction_shares) - 1) + [1.0], [2, 3])
    explicit = make_selector(InfiniGenConfig(budget=0.2, allocation="uniform", correction=0.03), adapter, rigged)
    assert not explicit.layer_corrections and explicit.correction(3) == 0.03 and explicit.speculated_budget(3) == 0.2
    off = make_selector(InfiniGenConfig(budget=0.2, allocation="uniform", correction=0.0), adapter, rigged)
    assert off.correction(3) == 0.0
    own = make_selector(InfiniGenConfig(budget=0.2, allocation="uniform", speculate_from="own"), adapter, rigged)
    assert not own.layer_corrections  # the layer's own query: nothing to correct


def test_an_artifact_without_correction_tables_is_recalibrated_or_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("qwen2")
    chosen = InfiniGenConfig(calibration_tokens=64)
    assert chosen.correction is None  # the default: chosen per layer
    with attach(model, chosen, progress=False) as session:
        art = session.artifact
    (path,) = (tmp_path / "skew").glob("*.safetensors")
    old = {"correction_errors": {}, "oracle_errors": {}, "correction_budgets": None, "correction_shares": None}
    SkewArtifact(**{**vars(art), **old}).save(path)
    given = tmp_path / "given.safetensors"
    given.write_bytes(path.read_bytes())
    with attach(model, chosen.replace(correction=0.0), skew=given, progress=False):  # a number needs no table
        pass
    with pytest.raises(SkewArtifactError, match="no correction tables.*infinigen skew"):
        attach(model, chosen, skew=given, progress=False)
    with pytest.warns(SkewArtifactWarning, match="no correction tables"):
        with attach(model, chosen, progress=False) as session:
            assert session.artifact.has_correction_tables()
    assert SkewArtifact.load(path).has_correction_tables()  # replaced in the cache


def test_the_skew_command_reports_the_layers_it_corrects(tmp_path, tiny_model_dir, capsys):
    from infinigen.cli import main

    out_file = tmp_path / "a.safetensors"
    args = ["skew", "--model", str(tiny_model_dir), "--quiet", "--calibration-tokens", "64", "--output", str(out_file)]
    assert main(args) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("correction at")]
    assert line and "10% budget (chosen per layer: above 1.5x the oracle's output error)" in line[0]
    assert main([*args, "--correction", "0.02", "--budget", "0.2"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("correction at")]
    assert line and "20% budget (0.02 everywhere)" in line[0] and "2: 2.0%" in line[0]
