"""`infinigen bench capacity` end to end on a tiny model folder: the JSON the issue names, the
largest batches ordered as the policies' bytes say, and a real decode at each."""

import json

import pytest

from conftest import one_error_line, run_cli


def test_capacity_plans_runs_and_writes_its_rows(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "cap"
    rc, text, err = run_cli(
        capsys, "bench", "capacity", "--model", str(tiny_model_dir), "--memory", "256KiB", "--context", "64",
        "--max-batch", "64", "--policies", "dense,full,infinigen", "--steps", "2", "--out", str(out),
        "--calibration-tokens", "64",
    )  # fmt: skip
    assert rc == 0, err
    data = json.loads((out / "bench_capacity.json").read_text())
    rows = {r["policy"]: r for r in data["rows"]}
    assert set(rows) == {"dense", "full", "infinigen"}
    for r in rows.values():
        assert {"policy", "max_tokens", "batch", "context", "tokens_per_s", "peak_rss_bytes", "fits"} <= set(r)
        assert r["fits"] is True and r["max_tokens"] == r["batch"] * 64 and r["tokens_per_s"] > 0
        assert sum(r["planned_bytes"].values()) <= 256 << 10
        assert r["compute_kv_bytes"] <= 256 << 10  # what the run kept, measured, within the budget
    assert data["meta"]["settings"]["budget_bytes"] == 256 << 10 and "commit" in data["meta"]


def test_a_policy_that_cannot_fit_one_sequence_says_why(tiny_model_dir, tmp_path, capsys):
    rc, _, err = run_cli(
        capsys, "bench", "capacity", "--model", str(tiny_model_dir), "--memory", "4KiB", "--context", "64",
        "--policies", "dense", "--no-run", "--out", str(tmp_path),
    )  # fmt: skip
    assert rc == 0, err
    row = json.loads((tmp_path / "bench_capacity.json").read_text())["rows"][0]
    assert row["batch"] == 0 and row["max_tokens"] == 0 and "need at least" in row["fits"]


def test_budget_is_the_fetch_fraction_and_memory_the_size(tiny_model_dir, tmp_path, capsys):
    """One flag, one meaning across commands: --budget is what a policy reads per step, --memory the bytes."""
    rc, _, err = run_cli(
        capsys, "bench", "capacity", "--model", str(tiny_model_dir), "--budget", "0.25", "--memory", "256KiB",
        "--context", "64", "--max-batch", "4", "--policies", "infinigen", "--no-run", "--out", str(tmp_path),
        "--calibration-tokens", "64",
    )  # fmt: skip
    assert rc == 0, err
    data = json.loads((tmp_path / "bench_capacity.json").read_text())
    assert data["rows"][0]["config"]["budget"] == 0.25 and data["meta"]["settings"]["budget_bytes"] == 256 << 10


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--memory", "0.1"], "argument --memory: '0.1' is not a memory size: give one such as 512MiB or 1GiB"),
        (["--memory", "lots"], "argument --memory: 'lots' is not a memory size"),
        (["--budget", "1GiB"], "argument --budget: budget takes a number"),
    ],
)
def test_a_bad_memory_or_budget_is_refused_in_its_own_name(flags, says, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "bench", "capacity", *flags, "--out", str(tmp_path / "out"))
    assert rc == 2 and says in one_error_line(err) and "compute_memory" not in err
    assert not (tmp_path / "out").exists()


def test_the_default_policies_are_every_system_of_the_config():
    """The default list follows `config.POLICIES` by a rule: every policy but an upper bound."""
    from infinigen.bench.capacity import DEFAULT_POLICIES, build_parser
    from infinigen.config import POLICIES

    assert DEFAULT_POLICIES == tuple(p for p, spec in POLICIES.items() if not spec.bound)
    assert {"dense", "int4", "full", "h2o", "quest", "infinigen"} <= set(DEFAULT_POLICIES)
    assert "oracle" not in DEFAULT_POLICIES
    assert build_parser().parse_args([]).policies == ",".join(DEFAULT_POLICIES)
