"""`attach` is the only code that changes a model, and leaving it restores the model exactly."""

import math

import pytest
import torch

from conftest import left_padded_batch, tiny_model
from infinigen import InfiniGenCache, InfiniGenConfig, attach
from infinigen.compat import cache_kwargs
from infinigen.config import POLICIES

CFG = InfiniGenConfig(calibration_tokens=64)


def snapshot(model):
    """Everything attach may touch: parameters (bit for bit), every module's attributes and
    hooks, the attention implementation, and whether `generate` is the class's own."""
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "modules": {name: sorted(vars(m)) for name, m in model.named_modules()},
        "hooks": {
            name: (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._forward_pre_hooks_with_kwargs))
            for name, m in model.named_modules()
        },
        "attn": model.config._attn_implementation,
        "own_generate": "generate" in vars(model),
        "config": model.config.to_dict(),
        "threads": torch.get_num_threads(),
    }


def assert_same(before, after):
    assert before["params"].keys() == after["params"].keys()
    for k, v in before["params"].items():
        assert torch.equal(v, after["params"][k]), k
    for key in ("modules", "hooks", "attn", "own_generate", "config", "threads"):
        assert before[key] == after[key], key


@pytest.mark.parametrize("family", ["llama", "opt", "qwen2"])
def test_leaving_the_block_restores_the_model_exactly(family):
    model = tiny_model(family)
    ids, mask = left_padded_batch()
    logits = model(input_ids=ids, attention_mask=mask).logits
    before = snapshot(model)
    with attach(model, CFG, progress=False) as session:
        assert model.config._attn_implementation == "infinigen" and "generate" in vars(model)
        assert session.folded == (family == "opt")  # no RoPE: the skew is folded into W_q, W_k
        if session.folded:
            assert not torch.equal(before["params"]["model.decoder.layers.2.self_attn.q_proj.weight"],
                                   model.state_dict()["model.decoder.layers.2.self_attn.q_proj.weight"])  # fmt: skip
        # the folded (or hooked) model computes the same function
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, logits, rtol=1e-4, atol=1e-4)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
    assert_same(before, snapshot(model))
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits)


def test_an_exception_inside_the_block_restores_the_model_too():
    model = tiny_model("opt")
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        with attach(model, CFG, progress=False):
            raise RuntimeError("boom")
    assert_same(before, snapshot(model))
    with attach(model, CFG, progress=False):  # and it can be attached again
        pass
    assert_same(before, snapshot(model))


def test_decode_steps_leave_a_core_to_the_prefetch_thread_and_threads_are_restored():
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    seen = []
    hook = model.model.layers[1].register_forward_pre_hook(
        lambda m, a: seen.append((a[0].shape[1], torch.get_num_threads()))
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        for cfg, decode_threads in ((CFG, 2), (CFG.replace(policy="dense"), 3), (CFG.replace(compute_threads=1), 1)):
            with attach(model, cfg, progress=False):
                seen.clear()  # not the attach self-check's forwards
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
            assert seen[0] == (ids.shape[1], 3)  # the prefill uses every thread
            assert {t for q, t in seen[1:]} == {decode_threads} and all(q == 1 for q, _ in seen[1:])
            assert torch.get_num_threads() == 3
    finally:
        hook.remove()
        torch.set_num_threads(before)


def test_plain_generate_inside_the_block_uses_an_infinigen_cache():
    model = tiny_model("mistral")
    ids, mask = left_padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref = model.generate(**kw)
    with attach(model, CFG.replace(alpha=math.inf, budget=1.0), progress=False) as session:
        out = model.generate(**kw)
        summary = session.last_cache.summary()
    assert torch.equal(out, ref)
    assert summary["decode_steps"] == 3 and summary["fetched_fraction"] == pytest.approx(1.0)


def test_one_session_at_a_time_and_none_after_detach():
    model = tiny_model("llama")
    session = attach(model, CFG, progress=False)
    with pytest.raises(RuntimeError, match="already attached"):
        attach(model, CFG, progress=False)
    session.detach()
    session.detach()  # idempotent
    with pytest.raises(RuntimeError, match="detached"):
        session.new_cache()


def test_a_cache_needs_a_session_and_says_how():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=r"attach\(model, config\) as session"):
        InfiniGenCache(model, CFG)


def test_one_session_serves_configs_with_other_skew_settings():
    """RoPE models apply the skew at run time: one session loads each artifact it is asked for."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    with attach(model, CFG, progress=False) as session:
        sparse = CFG.replace(alpha=1.0, min_tokens=2)
        for cfg in (
            sparse.replace(partial_ratio=0.5),
            sparse.replace(skew=False),
            sparse.replace(policy="h2o", budget=0.3),
        ):
            cache = session.new_cache(cfg)
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=3, **cache_kwargs(model, cache), pad_token_id=0
            )
            assert 0 < cache.summary()["fetched_fraction"] < 1


def test_a_folded_session_refuses_a_config_with_another_skew():
    model = tiny_model("opt")
    with attach(model, CFG, progress=False) as session:
        with pytest.raises(ValueError, match="folded into its weights.*attach again"):
            session.new_cache(CFG.replace(partial_ratio=0.3))
        session.new_cache(CFG.replace(policy="quest", budget=0.2))  # other selectors need no skew


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "infinigen"])
def test_a_policy_that_needs_no_skew_runs_at_once_without_calibrating(policy, monkeypatch, tmp_path):
    """Dense and the baselines read no skew artifact: on an empty cache they generate without the
    first-use calibration (minutes on a real model)."""
    import infinigen.calibration as calibration

    def refuse(*args, **kwargs):
        raise AssertionError("calibrated for a policy that needs no skew")

    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "calibrate_skew", refuse)
    monkeypatch.setattr(calibration.Calibrator, "measure", refuse)
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    with attach(model, InfiniGenConfig(policy=policy), progress=False) as session:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
        assert session.last_cache.summary()["decode_steps"] == 2
    assert not list(tmp_path.rglob("*.safetensors"))
