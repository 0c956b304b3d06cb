"""Every registered selector, run the same way: a policy added to `infinigen.select.SELECTORS` is
tested here without a line of its own.

On a tiny random model, each selecting policy decodes a few steps at a budget and keeps what every
selector must: the output is finite; each step attends exactly its selection and the current token
(the masked replay of tests/test_sparse.py); no selection holds more rows than the selector's own
bound (`max_rows`, what its transfer buffers are sized by). At the whole context each one equals
dense within float32 tolerance. Each selector's own rule is tested against a plain loop in
tests/test_policies.py.
"""

import pytest
import torch

from conftest import left_padded_batch, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.select import SELECTORS
from test_sparse import _forced, masked_replay, selections_by_step

STEPS = 4
SETTINGS = dict(calibration_tokens=64)  # InfiniGen calibrates on this many tokens of the tiny model


@pytest.mark.parametrize("name", list(SELECTORS))
def test_every_selector_attends_its_selection_and_the_current_token_within_its_bound(name):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=40, pad=9)
    config = InfiniGenConfig(policy=name, budget=0.3, **SETTINGS)
    with attach(model, config, progress=False) as session:
        cache = session.new_cache(trace=True)
        got = _forced(model, ids, mask, cache, STEPS)
    assert torch.isfinite(got).all()
    record = selections_by_step(cache.trace)
    assert sorted(record) == [ids.shape[1] + s for s in range(STEPS)]
    selector = cache.selector
    for past, layers in record.items():
        assert layers, f"step at {past}: no layer selected"
        for layer, (_, valid) in layers.items():
            most = selector.max_rows(layer, past)
            assert int(valid.sum(-1).max()) <= most, (past, layer)
    fractions = [p["fetched_fraction"] for p in cache.summary()["per_layer"] if p["speculated"]]
    assert fractions and max(fractions) < 0.9, "the selection must be sparse for this test to mean anything"
    torch.testing.assert_close(got, masked_replay(model, ids, mask, record, STEPS), rtol=1e-4, atol=1e-4)


def _dense_logits(model, ids, mask):
    with attach(model, InfiniGenConfig(policy="dense"), progress=False) as session:
        return _forced(model, ids, mask, session.new_cache(), STEPS)


@pytest.mark.parametrize("name", list(SELECTORS))
def test_every_selector_at_the_whole_context_equals_dense(name):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=24, pad=5)
    want = _dense_logits(model, ids, mask)
    with attach(model, InfiniGenConfig(policy=name, budget=1.0, **SETTINGS), progress=False) as session:
        cache = session.new_cache()
        got = _forced(model, ids, mask, cache, STEPS)
    assert cache.summary()["fetched_fraction"] == pytest.approx(1.0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
