"""The eval harness's bookkeeping: configs at matched budgets, targets, tables, plots, CLI errors."""

import math

import pytest

from infinigen.cli import main
from infinigen.eval.report import markdown, plots
from infinigen.eval.suite import EvalSettings, policy_configs
from infinigen.eval.targets import check_targets


def test_matched_budget_configs():
    runs = policy_configs(EvalSettings(budgets=(0.05, 0.2)))
    labels = [(p, b) for p, b, _ in runs]
    assert ("dense", None) in labels and ("int4", None) in labels and ("full", None) in labels
    for p in ("infinigen", "h2o", "streaming", "quest", "oracle"):
        assert (p, 0.05) in labels and (p, 0.2) in labels
    for p, b, cfg in runs:
        assert cfg.policy == p
        if b is not None:
            assert cfg.budget == b
        if p == "infinigen":
            assert math.isinf(cfg.alpha)  # exactly the budget: top positions of the speculated scores
        assert cfg.kv_dtype == "float16"


def _ppl_row(policy, budget, ppl, fetched, recall=None):
    return {
        "suite": "ppl",
        "dataset": "essays",
        "context": 2048,
        "window": 0,
        "policy": policy,
        "budget": budget,
        "ppl": ppl,
        "fetched_fraction": fetched,
        "bytes_fraction": None if fetched is None else fetched * 0.9,
        "recall": recall,
        "top1_agreement": 0.9,
        "kl": 0.1,
    }


def _rows():
    rows = [
        _ppl_row("dense", None, 20.0, None),
        _ppl_row("int4", None, 21.0, 1.0),
        _ppl_row("oracle", 0.1, 20.2, 0.1, 0.95),
        _ppl_row("infinigen", 0.1, 20.25, 0.1, 0.93),
        _ppl_row("infinigen", 0.2, 20.3, 0.2, 0.96),
        _ppl_row("h2o", 0.1, 22.0, 0.1, 0.8),
        _ppl_row("streaming", 0.1, 20.1, 0.1, 0.7),
    ]
    for pol, budget, ok in [("dense", None, True), ("infinigen", 0.1, False), ("h2o", 0.1, False)]:
        rows.append({"suite": "passkey", "policy": pol, "budget": budget, "length": 1024, "depth": 0.5, "correct": ok})
    return rows


def test_targets_are_checked_on_the_numbers():
    checks = {c["target"]: c["met"] for c in check_targets(_rows())["checks"]}
    assert checks["Δppl at 10% budget <= 1.5 x oracle's"] is True  # +0.25 vs +0.2
    assert checks["ppl within 2% of dense at <= 20% fetched"] is True  # +1.25%
    assert checks["attention recall >= 0.9 at <= 15% fetched"] is True
    assert checks["ppl below h2o at every budget"] is True
    assert checks["ppl below streaming at every budget"] is False  # 20.25 vs 20.1
    assert checks["ppl below int4 with fewer bytes"] is True
    assert checks["infinigen@0.1 correct wherever dense is"] is False
    assert checks["infinigen@0.1 retrieves at least as often as h2o"] is True


def test_markdown_and_plots(tmp_path):
    rows = _rows()
    md = markdown(rows, {"model": "m", "commit": "c", "machine": "x", "kv_dtype": "float16", "command": "cmd"})
    assert "| infinigen | 10% | 10.0% |" in md and "passkey" in md
    written = plots(rows, tmp_path)
    assert {p.name for p in written} == {"quality_vs_fetched.png", "passkey_vs_length.png"}
    assert all(p.stat().st_size > 1000 for p in written)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["eval", "--suite", "ppl,typo"], "unknown suite"),
        (["eval", "--policies", "dense,nope"], "unknown policies"),
        (["eval", "--budgets", "0.1,1.5"], "--budgets"),
        (["eval", "--contexts", "400", "--score-tokens", "512"], "exceed --score-tokens"),
    ],
)
def test_eval_refuses_bad_arguments_before_loading_a_model(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_layer_table_ranks_layers_by_gap_to_the_oracle():
    from infinigen.eval.report import layer_table

    rows = _rows()
    for r in rows:
        if r.get("budget") == 0.1 and r["policy"] in ("infinigen", "oracle"):
            ig = r["policy"] == "infinigen"
            r["per_layer_recall"] = {"2": 0.6 if ig else 0.9, "3": 0.88 if ig else 0.9}
            r["per_layer_fraction"] = {"2": 0.1, "3": 0.1}
            r["per_head_recall"] = {"2": [0.5, 0.7], "3": [0.9, 0.86]}
    table = layer_table(rows)
    lines = [ln for ln in table.splitlines() if ln.startswith("| 2 ") or ln.startswith("| 3 ")]
    assert lines[0].startswith("| 2 | 0.600 | 0.900 | -0.300 | h0 0.50, h1 0.70")
    assert lines[1].startswith("| 3 ")


def test_the_variants_suite_runs_every_window_and_reports_their_mean(tmp_path, tiny_model_dir):
    """`--windows` applies to the variants suite as to ppl: one row per window, and the table's
    figures are the windows' mean."""
    import json

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "out"
    argv = ["eval", "--model", str(tiny_model_dir), "--quiet", "--suite", "variants", "--text-file", str(text)]
    argv += ["--contexts", "96", "--score-tokens", "16", "--windows", "2", "--variant-budget", "0.25"]
    argv += ["--variant", "u:policy=infinigen allocation=uniform calibration_tokens=64", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads((out / "eval.json").read_text())["rows"]
    by = {(r["policy"], r["window"]): r for r in rows}
    assert set(by) == {(p, w) for p in ("dense", "oracle", "u") for w in (0, 1)}
    md = (out / "eval.md").read_text()
    assert "(mean over 2 windows)" in md
    mean_ppl = (by[("u", 0)]["ppl"] + by[("u", 1)]["ppl"]) / 2
    line = next(x for x in md.splitlines() if x.startswith("| u |"))
    assert f"| {mean_ppl:.2f} |" in line
