"""The vectorized evaluator equals the real step-by-step decode path, policy by policy."""

import pytest
import torch

from conftest import VOCAB, tiny_model
from infinigen import InfiniGenConfig
from infinigen.eval.evaluator import Evaluator
from infinigen.eval.stepwise import forced_logits
from infinigen.storage import row_bytes

BASE = dict(calibration_tokens=64, measure_recall=True)
CONFIGS = {
    "dense": InfiniGenConfig(policy="dense", **BASE),
    "full": InfiniGenConfig(policy="full", kv_dtype="float16", **BASE),
    "int4": InfiniGenConfig(policy="int4", kv_dtype="float16", **BASE),
    "infinigen": InfiniGenConfig(alpha=0.5, min_tokens=2, **BASE),
    "infinigen-fp16-streamed": InfiniGenConfig(
        alpha=0.5, min_tokens=2, kv_dtype="float16", dense_layers_on_compute=False, **BASE
    ),
    "infinigen-mass-budget": InfiniGenConfig(alpha=float("inf"), budget=0.25, aggregation="mass", **BASE),
    "infinigen-calibrated": InfiniGenConfig(alpha=float("inf"), budget=0.25, allocation="calibrated", **BASE),
    "infinigen-correct": InfiniGenConfig(
        alpha=float("inf"), budget=0.15, correction=0.1, kv_dtype="float16", aggregation="mass", **BASE
    ),
    # the top-ups chosen per layer from calibration (a target of 1: wherever speculation errs more than the oracle)
    "infinigen-chosen-correction": InfiniGenConfig(alpha=float("inf"), budget=0.25, correction_target=1.0, **BASE),
    "infinigen-own-query": InfiniGenConfig(alpha=float("inf"), budget=0.2, speculate_from="own", **BASE),
    "infinigen-previous-input": InfiniGenConfig(alpha=float("inf"), budget=0.2, speculate_from="previous", **BASE),
    "h2o": InfiniGenConfig(policy="h2o", budget=0.3, **BASE),
    "streaming": InfiniGenConfig(policy="streaming", budget=0.3, sinks=2, **BASE),
    "quest": InfiniGenConfig(policy="quest", budget=0.3, page_tokens=4, kv_dtype="float16", **BASE),
    "oracle": InfiniGenConfig(policy="oracle", budget=0.2, **BASE),
}


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 56), generator=torch.Generator().manual_seed(3))
    return model, ids


@pytest.mark.parametrize("name", list(CONFIGS))
def test_vectorized_evaluator_equals_step_by_step_decode(setup, name):
    model, ids = setup
    cfg = CONFIGS[name]
    prefix_len, steps = 40, 12
    step = forced_logits(model, ids, prefix_len, steps + 1, cfg, progress=False)
    with Evaluator(model) as ev:
        prefix = ev.prefill(ids[:, :prefix_len])
        keys = [layer.keys.clone() for layer in prefix.cache.layers]
        got = ev.run(prefix, ids[:, prefix_len : prefix_len + steps], cfg, measure_recall=True)
    torch.testing.assert_close(prefix.last_logits[0], step.logits[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.logits[0], step.logits[1:], rtol=1e-4, atol=1e-4)
    s = step.summary
    assert got.bytes_fetched == s["bytes_fetched"] and got.rows_fetched == s["rows_fetched"]
    per_row = row_bytes("native", model.config.head_dim, cfg.storage_dtype() or torch.float32)
    assert got.correction_rows * per_row == s["correction_bytes"]
    if name in ("infinigen-correct", "infinigen-chosen-correction"):
        assert got.correction_rows > 0, "the correction must fetch something to be tested"
    spec = [p for p in s["per_layer"] if p["speculated"]]
    if spec:
        assert got.per_layer_fraction == pytest.approx({p["layer"]: p["fetched_fraction"] for p in spec}, abs=1e-6)
        assert got.per_layer_recall == pytest.approx({p["layer"]: p["recall"] for p in spec}, abs=1e-4)
        assert max(got.per_layer_fraction.values()) < 0.8, "the selection must be sparse to mean anything"
    # The shared prefill is left as it was, so the next policy starts from the same prefix.
    assert prefix.cache.get_seq_length() == prefix_len
    assert all(torch.equal(a, layer.keys) for a, layer in zip(keys, prefix.cache.layers))
    assert model.config._attn_implementation == "sdpa"  # the evaluator detached on exit
