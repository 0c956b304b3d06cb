"""Fetch-everything mode must reproduce the unmodified model exactly (fp32 tolerance)."""

import math

import pytest
import torch
from transformers import DynamicCache

from conftest import FAMILIES, left_padded_batch, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.compat import cache_kwargs

pytestmark = pytest.mark.compat  # CI runs these on the newest admitted transformers too

FETCH_ALL = InfiniGenConfig(alpha=math.inf, budget=1.0, calibration_tokens=64)


def _generate(model, ids, mask, cache):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        **cache_kwargs(model, cache),
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("on_compute", [True, False])
def test_fetch_everything_matches_dynamic_cache(family, batch, on_compute):
    model = tiny_model(family)
    ids, mask = left_padded_batch()
    if batch == 1:
        ids, mask = ids[:1], mask[:1]
    ref = _generate(model, ids, mask, DynamicCache(config=model.config))
    config = FETCH_ALL.replace(dense_layers_on_compute=on_compute)
    with attach(model, config, progress=False) as session:
        cache = session.new_cache()
        out = _generate(model, ids, mask, cache)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    s = cache.summary()
    assert s["decode_steps"] == 7 and s["fetched_fraction"] == pytest.approx(1.0)
    # Exact row count: the dense layers either keep their KV with the compute (nothing read)
    # or read every stored row (padding included, one bulk read); the speculated layers read
    # only the selected rows, i.e. every real row at alpha = inf.
    hkv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    layers, dense = model.config.num_hidden_layers, FETCH_ALL.dense_layers
    length, real = ids.shape[1], mask.sum(-1)
    want = 0
    for step in range(7):  # decode steps after the prefill
        past = length + step
        want += 0 if on_compute else dense * ids.shape[0] * past * hkv
        want += (layers - dense) * int((real + step).sum()) * hkv
    assert s["rows_fetched"] == want


@pytest.mark.parametrize("family", FAMILIES)
def test_policies_full_and_dense_match_reference(family):
    model = tiny_model(family)
    ids, mask = left_padded_batch()
    ref = _generate(model, ids, mask, DynamicCache(config=model.config))
    for policy in ("full", "dense"):
        with attach(model, InfiniGenConfig(policy=policy), progress=False) as session:
            cache = session.new_cache()
            out = _generate(model, ids, mask, cache)
        assert torch.equal(out.sequences, ref.sequences), policy
        for a, b in zip(out.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        s = cache.summary()
        if policy == "dense":
            assert s["bytes_fetched"] == 0 and s["fetched_fraction"] is None
        else:
            assert s["fetched_fraction"] == 1.0 and s["bytes_fetched"] > 0
