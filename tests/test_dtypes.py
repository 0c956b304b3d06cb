"""16-bit models (bfloat16, float16) run every policy inside `attach`, calibration included: the
speculation computes in float32 (a 16-bit model's weights are exact in float32), the KV is stored
in the model's 16 bits, and a bfloat16 copy of a float32 model reuses its calibration."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from transformers import DynamicCache

from conftest import greedy_with_logits, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.compat import cache_kwargs
from infinigen.config import POLICIES
from infinigen.skew import model_fingerprint
from infinigen.skew.choice import stored_choice

HALF = [torch.bfloat16, torch.float16]
CFG = InfiniGenConfig(calibration_tokens=64)
PROMPT, FORCED = 128, 32


@pytest.mark.parametrize("dtype", HALF)
def test_every_policy_runs_on_a_16_bit_model(dtype):
    model = tiny_model("llama").to(dtype)
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    for policy in POLICIES:
        with attach(model, CFG.replace(policy=policy), progress=False) as session:
            out = model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
            s = session.last_cache.summary()
        assert out.shape[-1] == ids.shape[-1] + 4, policy
        assert s["decode_steps"] == 3, policy
        assert (s["bytes_fetched"] > 0) == (policy != "dense"), policy


@pytest.mark.compat
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_full_equals_the_unmodified_16_bit_model(dtype, family):
    """Every row read back from the slow tier, the model computes what it computes alone: the
    same greedy tokens, logits equal within the dtype's own tolerance (they are bit-equal today)."""
    model = tiny_model(family).to(dtype)
    ref = greedy_with_logits(model, DynamicCache(config=model.config), new_tokens=8)
    with attach(model, InfiniGenConfig(policy="full"), progress=False) as session:
        cache = session.new_cache()
        out = greedy_with_logits(model, cache, new_tokens=8)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a.to(dtype), b.to(dtype))  # the dtype's default rtol / atol
    s = cache.summary()
    assert s["fetched_fraction"] == 1.0 and s["bytes_fetched"] > 0


@torch.no_grad()
def _forced_argmax(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Greedy choices [FORCED] after a PROMPT-token prefill, feeding `ids`' own next tokens one decode
    step at a time through `cache` (teacher forcing: one early miss does not derail the rest)."""
    out = model(input_ids=ids[:, :PROMPT], **cache_kwargs(model, cache), use_cache=True)
    choices = [out.logits[0, -1].argmax()]
    for t in range(PROMPT, PROMPT + FORCED - 1):
        out = model(input_ids=ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True)
        choices.append(out.logits[0, -1].argmax())
    return torch.stack(choices)


@functools.cache
def _float32_agreement(family: str) -> float:
    return _agreement(tiny_model(family))[0]


def _agreement(model) -> tuple[float, dict]:
    """Share of InfiniGen's greedy choices (the default 10 % budget) equal to dense's, and its cache summary."""
    ids = torch.randint(3, 96, (1, PROMPT + FORCED), generator=torch.Generator().manual_seed(3))
    dense = _forced_argmax(model, DynamicCache(config=model.config), ids)
    with attach(model, CFG, progress=False) as session:
        cache = session.new_cache()
        ours = _forced_argmax(model, cache, ids)
        summary = cache.summary()
    return (ours == dense).float().mean().item(), summary


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_infinigen_on_a_16_bit_model_agrees_with_dense_as_in_float32(dtype, family):
    """At a 10 % budget InfiniGen differs from dense by its selection, not by the dtype: on the
    tiny random model (near-flat logits, so a few steps differ whatever the dtype: 0.66-0.84 in
    float32) its agreement with dense of the same dtype is float32's within two of the 32 steps
    (a near-tie flipped by 16-bit rounding), and its counters move as in float32, with 16-bit KV."""
    agreement, s = _agreement(tiny_model(family).to(dtype))
    assert agreement >= _float32_agreement(family) - 2 / FORCED
    assert s["decode_steps"] == FORCED - 1 and 0.05 < s["fetched_fraction"] < 0.2
    assert s["speculation_seconds"] > 0 and s["rows_fetched"] > 0
    head_dim = 64 // 4
    assert s["bytes_fetched"] == s["rows_fetched"] * 2 * head_dim * 2  # K and V rows of 2-byte values


def test_a_bfloat16_copy_reuses_the_float32_calibration(monkeypatch):
    """The fingerprint reads the weights rounded to bfloat16: the float32 model and its bfloat16
    copy share one artifact, skew and measured choice, so the copy calibrates nothing."""
    model = tiny_model("llama")
    with attach(model, CFG, progress=False) as session:
        choice = stored_choice(session.artifact)
    copy = tiny_model("llama").to(torch.bfloat16)
    assert model_fingerprint(copy) == model_fingerprint(model) != model_fingerprint(model, exact=True)
    calibration = sys.modules["infinigen.calibration"]
    monkeypatch.setattr(calibration, "calibrate_skew", lambda *a, **k: pytest.fail("calibrated again"))
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("measured again"))
    with attach(copy, CFG, progress=False) as session:
        assert stored_choice(session.artifact) == choice
        out = copy.generate(input_ids=torch.arange(3, 43)[None], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape[-1] == 43
