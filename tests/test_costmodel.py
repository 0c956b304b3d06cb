"""The cost model against hand-computed rooflines, and `bench model` end to end (no calibration)."""

import json

import pytest

from infinigen.bench.costmodel import HARDWARE, MODELS, Hardware, ModelShape, Workload, kv_bytes, predict
from infinigen.bench.model import MODELLED, UNMEASURED, validate
from infinigen.cli import main

TOY = ModelShape("toy", layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=100)
HW = Hardware("toy-hw", "toy", flops=1e12, mem_bw=1e10, mem_gb=1.0, link_bw=1e8, gather_bw=5e7)


def test_full_fetch_is_the_link_bound_roofline_by_hand():
    ctx, b = 4096, 2
    p = predict(HW, TOY, "full", ctx, b, Workload(fraction=1.0))
    layer_bytes = b * ctx * 2 * TOY.kv_heads * TOY.head_dim * 2
    lin = max(TOY.layer_params * 2 / HW.mem_bw, 2 * b * TOY.layer_params / HW.flops)
    attn = max(
        b * ctx * 2 * TOY.kv_heads * TOY.head_dim * 2 / HW.mem_bw, 4 * b * TOY.heads * ctx * TOY.head_dim / HW.flops
    )
    head = max(TOY.head_params * 2 / HW.mem_bw, 2 * b * TOY.head_params / HW.flops)
    step = head + TOY.layers * max(lin + attn, layer_bytes / HW.link_bw)
    assert p.step_ms == pytest.approx(1000 * step)
    assert p.tokens_per_s == pytest.approx(b / step)
    assert p.tier_bytes_per_token == pytest.approx(TOY.layers * layer_bytes / b)
    assert p.bound == "link"


def test_infinigen_moves_the_measured_fraction_of_the_speculated_layers():
    ctx = 8192
    w = Workload(fraction=0.05, amplification=1.5, dense_layers=1)
    full = predict(HW, TOY, "full", ctx, 1, w)
    inf = predict(HW, TOY, "infinigen", ctx, 1, w)
    per_layer = full.tier_bytes_per_token / TOY.layers
    # the dense layer stays with the compute; the three speculated ones move their fraction
    assert inf.tier_bytes_per_token == pytest.approx(per_layer * 3 * 0.05 * 1.5)
    assert inf.tokens_per_s > full.tokens_per_s  # link-bound: fewer bytes, faster


def test_what_does_not_fit_is_reported_not_timed():
    kv = kv_bytes(TOY, 4, 8192, 2)
    weights = (TOY.layer_params * TOY.layers + TOY.head_params) * 2
    w = Workload(fraction=0.05, dense_layers=1)
    roomy = Hardware("roomy", "", 1e12, 1e10, mem_gb=(weights + kv) * 1.01 / 1e9, link_bw=1e9, gather_bw=1e9)
    tight = Hardware("tight", "", 1e12, 1e10, mem_gb=(weights + kv) * 0.99 / 1e9, link_bw=1e9, gather_bw=1e9)
    assert predict(roomy, TOY, "dense", 8192, 4, w).tokens_per_s is not None
    p = predict(tight, TOY, "dense", 8192, 4, w)
    assert p.tokens_per_s is None and "does not fit" in p.note
    # InfiniGen keeps one layer's KV, the partial keys (5 of 16 channels of K) and two buffers
    assert predict(tight, TOY, "infinigen", 8192, 4, w).tokens_per_s is not None
    tiny = Hardware("tiny", "", 1e12, 1e10, mem_gb=(weights + kv / 4) / 1e9, link_bw=1e9, gather_bw=1e9)
    assert predict(tiny, TOY, "infinigen", 8192, 4, w).tokens_per_s is None


def test_the_modelled_policies_are_the_configs_but_the_upper_bound():
    """The cost model reads what each policy means (`config.POLICIES`), not a list of its own:
    every policy is modelled but the oracle, which is refused in one sentence."""
    from infinigen.bench.costmodel import POLICIES as MODELLED_POLICIES
    from infinigen.config import POLICIES

    assert MODELLED_POLICIES == tuple(p for p, spec in POLICIES.items() if not spec.bound)
    assert {"dense", "full", "int4", "h2o", "infinigen"} <= set(MODELLED_POLICIES)
    w = Workload(fraction=0.05)
    for p in MODELLED_POLICIES:
        assert predict(HW, TOY, p, 4096, 1, w).tokens_per_s > 0, p
    with pytest.raises(ValueError, match="policy 'oracle' is not modelled: it is an upper bound"):
        predict(HW, TOY, "oracle", 4096, 1, w)
    with pytest.raises(ValueError, match="unknown policy 'nope'; modelled: infinigen, dense"):
        predict(HW, TOY, "nope", 4096, 1, w)


def test_a_baseline_reads_its_budget_overlapped_unless_it_needs_the_layers_own_query():
    """StreamingLLM chooses without a query: its rows are read as one range, overlapped. Quest ranks
    pages with the layer's own query: scattered rows gathered, after the layer's compute."""
    ctx, b = 4096, 1
    w = Workload(fraction=0.05, dense_layers=1, budgets={"streaming": 0.25, "quest": 0.25})
    row = 2 * TOY.kv_heads * TOY.head_dim * 2
    lin = max(TOY.layer_params * 2 / HW.mem_bw, 2 * b * TOY.layer_params / HW.flops)
    head = max(TOY.head_params * 2 / HW.mem_bw, 2 * b * TOY.head_params / HW.flops)

    def attn(rows):
        return max(b * rows * row / HW.mem_bw, 4 * b * TOY.heads * rows * TOY.head_dim / HW.flops)

    rows = 0.25 * ctx
    kept = lin + attn(ctx)  # the dense layer, with the compute
    streaming = head + kept + 3 * max(lin + attn(rows), b * rows * row / HW.link_bw)
    quest = head + kept + 3 * (lin + attn(rows) + b * rows * row / HW.gather_bw)
    assert predict(HW, TOY, "streaming", ctx, b, w).step_ms == pytest.approx(1000 * streaming)
    assert predict(HW, TOY, "quest", ctx, b, w).step_ms == pytest.approx(1000 * quest)
    # a baseline not named in `budgets` reads its policy's default budget
    default = predict(HW, TOY, "streaming", ctx, b, Workload(fraction=0.05, dense_layers=1))
    assert default.tier_bytes_per_token == pytest.approx(3 * 0.1 * ctx * row)


@pytest.mark.parametrize("hw", list(HARDWARE))
def test_named_hardware_orders_policies_as_the_bytes_say(hw):
    m = MODELS["llama-3.1-8b"]
    w = Workload(fraction=0.05)
    slow = [predict(HARDWARE[hw], m, "full", c, 1, w).tokens_per_s for c in (4096, 32768, 131072)]
    assert slow[0] > slow[1] > slow[2], "full fetch slows as the context grows"
    assert predict(HARDWARE[hw], m, "infinigen", 131072, 1, w).tokens_per_s > slow[2]


def test_validation_reports_the_error_against_measured_rows():
    shape = MODELS["smollm2-135m"]
    hw = Hardware("cpu", "cpu", 1e11, 1e10, None, 3e8, 1e8, kv_compute_bytes=4, spec_on_compute=False)
    pred = predict(hw, shape, "full", 2048, 1, Workload(fraction=1.0))
    rows = [{"policy": "full", "context": 2048, "batch": 1, "tokens_per_s": pred.tokens_per_s * 1.25}]
    (check,) = validate(rows, hw)
    assert check["error"] == pytest.approx(1 / 1.25 - 1)
    assert check["within_25pct"]


def test_bench_model_prints_and_writes_a_modelled_table(tmp_path, capsys):
    measured = tmp_path / "bench.json"
    rows = [{"policy": "infinigen", "context": 2048, "batch": 1, "fetched_fraction": 0.1}]
    measured.write_text(json.dumps({"rows": rows}))
    argv = ["bench", "model", "--hardware", "a100-pcie4", "--models", "opt-13b", "--contexts", "4096",
            "--batches", "1", "--measured", str(measured), "--paper", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert MODELLED in printed and "InfiniGen" in printed
    report = json.loads((tmp_path / "out" / "bench_model.json").read_text())
    assert report["meta"]["label"] == MODELLED
    assert {r["policy"] for r in report["table"]} == {"dense", "full", "infinigen"}
    assert report["paper"]["default_fraction"] == 0.1
    assert main([*argv[:3], "h999", *argv[4:]]) == 2
    assert capsys.readouterr().err.startswith("error: unknown hardware 'h999'")


def test_bench_model_runs_with_its_defaults_from_any_folder(tmp_path, monkeypatch, capsys):
    """As the README lists it: no flags, no docs/ folder, no measured JSON; it says it is unmeasured."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "model"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == UNMEASURED and MODELLED in printed
    report = json.loads((tmp_path / "results" / "model" / "bench_model.json").read_text())
    infinigen = [r for r in report["table"] if r["policy"] == "infinigen"]
    assert infinigen and all(r["fraction_source"] == "the default budget (not measured)" for r in infinigen)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--measured", "nope.json"], "error: --measured nope.json: no such file"),
        (["--calibrate"], "error: --calibrate checks the model against measured rows"),
    ],
)
def test_bench_model_refuses_a_missing_measured_file_in_one_line(flags, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "model", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and len(err.splitlines()) == 1
    assert not (tmp_path / "results").exists()  # refused before anything is written
