"""Bad input fails early, clearly, and leaves nothing half-done."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import left_padded_batch, tiny_model
from infinigen import ContextTooLongError, InfiniGenConfig, UnsupportedModelError, attach
from infinigen.compat import cache_kwargs


def test_unsupported_architecture_names_the_supported_ones():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50)).eval()
    with pytest.raises(UnsupportedModelError, match="gpt2.*supported: gemma3_text, llama, mistral, opt, qwen2, qwen3"):
        attach(model, InfiniGenConfig(), progress=False)
    assert model.config._attn_implementation != "infinigen" and "generate" not in vars(model)


def test_prompt_longer_than_context_fails_before_any_work():
    model = tiny_model("llama")  # 256 positions
    ids = torch.randint(3, 96, (1, 300))
    with attach(model, InfiniGenConfig(calibration_tokens=64), progress=False) as session:
        cache = session.new_cache()
        with pytest.raises(ContextTooLongError, match="300 tokens exceed the model's context of 256"):
            model.generate(input_ids=ids, max_new_tokens=2, **cache_kwargs(model, cache), do_sample=False)
        assert cache.get_seq_length() == 0 and cache.summary()["bytes_fetched"] == 0
        with pytest.raises(ContextTooLongError, match="max_length"):
            session.new_cache(max_length=257)


def test_generation_check_counts_new_tokens():
    from infinigen.generation import check_context

    model = tiny_model("llama")
    check_context(model, 200, 56)
    with pytest.raises(ContextTooLongError, match="exceeds the model's context of 256"):
        check_context(model, 200, 57)


def test_beam_search_is_refused_clearly():
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    with attach(model, InfiniGenConfig(calibration_tokens=64), progress=False) as session:
        with pytest.raises(NotImplementedError, match="beam search|num_return_sequences"):
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=2, **cache_kwargs(model, session.new_cache()),
                pad_token_id=0,
            )  # fmt: skip


def test_attach_wraps_generate_and_detach_restores_it():
    model = tiny_model("mistral")
    ids, mask = left_padded_batch()
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with attach(model, InfiniGenConfig(alpha=float("inf"), budget=1.0, calibration_tokens=64), progress=False) as att:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert att.model is model
    assert torch.equal(out, ref)
    assert "generate" not in model.__dict__
    assert model.config._attn_implementation == "sdpa"


def test_eval_set_overrides_are_typed_and_validated():
    from infinigen.cli import eval_overrides

    assert eval_overrides(["partial_ratio=0.5", "skew=off", "dense-layers=3", "aggregation=mass", "sinks=2"]) == {
        "partial_ratio": 0.5,
        "skew": False,
        "dense_layers": 3,
        "aggregation": "mass",
        "sinks": 2,
    }
    assert eval_overrides(["layer_alpha=2:6,25:inf", "host_capacity=none"]) == {
        "layer_alpha": {2: 6.0, 25: float("inf")},
        "host_capacity": None,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        eval_overrides(["budget=0.5"])  # the eval sets budgets itself
    with pytest.raises(ValueError, match="takes an integer"):
        eval_overrides(["dense_layers=two"])
    with pytest.raises(ValueError, match="partial_ratio"):
        eval_overrides(["partial_ratio=1.5"])  # InfiniGenConfig's own check, before any model loads


def test_settings_naming_layers_the_model_lacks_are_refused():
    from infinigen import ConfigError

    model = tiny_model("llama")  # 4 layers
    with pytest.raises(ConfigError, match="layer_alpha names layer 7, but the model has 4 layers"):
        attach(model, InfiniGenConfig(layer_alpha={2: 6.0, 7: 6.0}), progress=False)
    assert "generate" not in vars(model)
    with attach(model, InfiniGenConfig(calibration_tokens=64), progress=False) as session:
        with pytest.raises(ConfigError, match="layer_alpha names layer -1"):
            session.new_cache(InfiniGenConfig(calibration_tokens=64, layer_alpha={-1: 2.0}))
