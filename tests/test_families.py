"""Today's families and odd shapes: Llama-3 RoPE scaling (llama3 / yarn / dynamic), Qwen2 biases,
Qwen3 q/k norms, Mistral (with and without a sliding window), hybrid sliding / global models
(Qwen2 `layer_types`, Gemma-3) and odd head shapes, each a tiny random config (`tiny_variant`).

The reference is always the unmodified model with transformers' own cache: full fetch must
reproduce it exactly (tokens, and logits at fp32 tolerance), with contexts longer than the
sliding window, and InfiniGen must run on each (select, fetch less, measure recall)."""

import math

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from conftest import VARIANTS, VOCAB, WINDOW, left_padded_batch, tiny_variant
from infinigen import InfiniGenConfig, attach
from infinigen.compat import cache_kwargs
from infinigen.eval.evaluator import Evaluator
from infinigen.eval.stepwise import forced_logits
from infinigen.models import UnsupportedModelError, get_adapter
from infinigen.roles import Role

FETCH_ALL = InfiniGenConfig(alpha=math.inf, budget=1.0, calibration_tokens=64)
# Partial keys in the KV's dtype: the evaluator forms the keys in one forward, decode one step at a time,
# equal to float rounding, which an int8 code can round apart at a near-tie (int8 itself: test_forced.py).
SPARSE = InfiniGenConfig(alpha=math.inf, budget=0.3, calibration_tokens=64, measure_recall=True, partial_format="kv")
HYBRID = ["qwen2-hybrid", "gemma3", "mistral-sliding"]


def _generate(model, ids, mask, cache, new=8):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **cache_kwargs(model, cache),
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip


def _batch():
    """Two left-padded rows of 24 positions (three times the sliding window)."""
    return left_padded_batch(length=3 * WINDOW)


@pytest.mark.compat
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("policy", ["full-fetch", "full"])
def test_full_fetch_equals_the_model_with_its_own_cache(name, policy):
    model = tiny_variant(name)
    ids, mask = _batch()
    # A model of its own for the reference: a dynamic RoPE keeps the longest length it has seen.
    ref = _generate(tiny_variant(name), ids, mask, DynamicCache(config=model.config))
    config = FETCH_ALL if policy == "full-fetch" else InfiniGenConfig(policy="full")
    with attach(model, config, progress=False) as session:
        cache = session.new_cache()
        out = _generate(model, ids, mask, cache)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    adapter = session.adapter
    roles = [p["role"] for p in cache.summary()["per_layer"]]
    # a sliding layer keeps its window, or reads it back where the default memory aim plans so
    assert [Role(r).sliding for r in roles] == [adapter.is_local(i) for i in range(adapter.num_layers)]


@pytest.mark.parametrize("name", [v for v in VARIANTS if v != "mistral-sliding"])
def test_infinigen_selects_on_each(name):
    model = tiny_variant(name)
    ids, mask = _batch()
    with attach(model, SPARSE, progress=False) as session:
        cache = session.new_cache()
        out = _generate(model, ids, mask, cache)
    assert out.sequences.shape == (2, ids.shape[1] + 8)
    s = cache.summary()
    speculated = [p for p in s["per_layer"] if p["speculated"]]
    assert speculated, "some layer must be speculated"
    assert all(not session.adapter.is_local(p["layer"]) for p in speculated)
    assert 0.0 < s["fetched_fraction"] < 0.6
    assert 0.0 < s["recall"] <= 1.0 + 1e-6


@pytest.mark.parametrize("name", ["gemma3", "qwen2-hybrid"])
def test_calibrated_budgets_average_over_the_selecting_layers_only(name):
    """On a hybrid model the budget is the mean over the layers that select (global, not dense):
    local layers get no share of it, so the selecting layers' fractions average to the budget."""
    model = tiny_variant(name)
    ids, mask = _batch()
    config = InfiniGenConfig(budget=0.3, allocation="calibrated", calibration_tokens=64)
    with attach(model, config, progress=False) as session:
        cache = session.new_cache()
        _generate(model, ids, mask, cache, new=2)
    per_layer = cache.summary()["per_layer"]
    selecting = [p for p in per_layer if p["role"] == "select"]
    assert selecting and all(not session.adapter.is_local(p["layer"]) for p in selecting)
    assert all(p["budget"] is None for p in per_layer if p["role"] != "select")
    assert sum(p["budget"] for p in selecting) / len(selecting) == pytest.approx(0.3, abs=1e-9)


@pytest.mark.parametrize("name", HYBRID)
@pytest.mark.parametrize("kv_dtype", [None, "float16"])
def test_local_layers_hold_only_their_window(name, kv_dtype):
    """Local layers keep window - 1 positions with the compute, in the KV's storage dtype, and are
    not offloaded without a budget (`windows_on_compute`): the offloaded bytes are those of the
    global layers alone."""
    model = tiny_variant(name)
    ids, mask = _batch()
    config = InfiniGenConfig(policy="full", kv_dtype=kv_dtype, compute_memory=None)
    with attach(model, config, progress=False) as session:
        cache = session.new_cache()
        _generate(model, ids, mask, cache)
    a = session.adapter
    item = 2 if kv_dtype else 4
    local = [i for i in range(a.num_layers) if a.is_local(i)]
    assert local and all(cache.layers[i].get_seq_length() == ids.shape[1] + 7 for i in local)
    s = cache.summary()
    assert s["local_kv_bytes"] == len(local) * 2 * 2 * a.num_kv_heads * (WINDOW - 1) * a.head_dim * item
    assert s["memory"]["compute_parts"]["local_layers"] == s["local_kv_bytes"]
    assert cache.storage.layers == a.num_layers - len(local)
    if len(local) == a.num_layers:
        assert s["bytes_fetched"] == 0 and s["fetched_fraction"] is None
    else:
        per_row = 2 * a.num_kv_heads * a.head_dim * item  # K and V of one position as stored
        # Each of the 7 decode steps reads every stored position (padding too) of each global layer.
        rows = sum(2 * (ids.shape[1] + step) for step in range(7)) * (a.num_layers - len(local))
        assert s["bytes_fetched"] == rows * per_row


# The evaluator runs a config as given, so decoding runs it without a memory plan too (the default
# aim's lossless changes would move the same rows from elsewhere: other bytes, the same logits).
FORCED = {
    "full": InfiniGenConfig(policy="full", measure_recall=True),
    "infinigen": SPARSE,
    # every layer kept or stored in 16 bits: local windows and dense layers too, the current token exact
    "infinigen-fp16": SPARSE.replace(kv_dtype="float16"),
    "int4": InfiniGenConfig(policy="int4", kv_dtype="float16"),
    # the sliding windows read back from the tier each step (the same rows, counted as read)
    "full-windows": InfiniGenConfig(policy="full", windows_on_compute=False, measure_recall=True),
    "infinigen-windows": SPARSE.replace(kv_dtype="float16", windows_on_compute=False),
}


@pytest.mark.compat
@pytest.mark.parametrize("name", ["gemma3", "qwen2-hybrid", "qwen3"])
@pytest.mark.parametrize("policy", list(FORCED))
def test_evaluator_equals_step_by_step_decode(name, policy):
    """The teacher-forced evaluator handles local layers exactly as decoding does."""
    model = tiny_variant(name)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    cfg = FORCED[policy].replace(compute_memory=None)
    prefix_len, steps = 28, 10
    step = forced_logits(model, ids, prefix_len, steps + 1, cfg, progress=False)
    with Evaluator(model) as ev:
        prefix = ev.prefill(ids[:, :prefix_len])
        got = ev.run(prefix, ids[:, prefix_len : prefix_len + steps], cfg, measure_recall=True)
    # tighter than the 16-bit rounding of a window (about 1e-4 here): that rounding is part of what is checked
    torch.testing.assert_close(got.logits[0], step.logits[1:], rtol=1e-5, atol=2e-5)
    s = step.summary
    assert got.bytes_fetched == s["bytes_fetched"] and got.rows_fetched == s["rows_fetched"]
    spec = [p for p in s["per_layer"] if p["speculated"]]
    if cfg.policy == "infinigen":
        assert spec
        assert got.per_layer_fraction == pytest.approx({p["layer"]: p["fetched_fraction"] for p in spec}, abs=1e-6)
        assert got.per_layer_recall == pytest.approx({p["layer"]: p["recall"] for p in spec}, abs=1e-4)


def test_gemma3_global_layer_is_speculated_with_the_global_rope():
    """Gemma-3's local and global layers rotate by different RoPE bases: the query speculated for
    a global layer from a local layer's input must use the embedding the global layer itself gets."""
    model = tiny_variant("gemma3")
    adapter = get_adapter(model)
    seen = {}

    def grab(module, args, kwargs, i):
        seen[i] = (kwargs["position_embeddings"], kwargs["position_ids"], kwargs["hidden_states"])

    mods = adapter.attention_modules()
    handles = [
        m.register_forward_pre_hook(lambda m, a, k, i=i: grab(m, a, k, i), with_kwargs=True) for i, m in enumerate(mods)
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(3, 3 + 20)[None])
    finally:
        for h in handles:
            h.remove()
    local_pe, pos, x = seen[1]
    global_pe = seen[2][0]
    assert adapter.is_local(1) and not adapter.is_local(2)
    assert not torch.allclose(local_pe[0], global_pe[0]), "the test needs RoPEs that differ"
    got = adapter.rope_for(2, 1, local_pe, pos, x)
    torch.testing.assert_close(got[0], global_pe[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], global_pe[1], rtol=0, atol=0)
    assert adapter.rope_for(3, 1, local_pe, pos, x) is local_pe  # same kind: handed as is


def test_unsupported_models_say_what_is_supported():
    gemma2 = Gemma2ForCausalLM(
        Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"'gemma2' is not supported.*soft-caps.*supported: .*gemma3_text"):
        get_adapter(gemma2)
    capped = Gemma3ForCausalLM(
        Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, attn_logit_softcapping=50.0)
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        get_adapter(capped)


@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_chunked_prefill_is_the_same_prefill(name):
    """The evaluator and the benchmark prefill long prompts in chunks: same KV, same next token."""
    from infinigen.prefill import chunked_prefill

    model = tiny_variant(name)
    ids = torch.randint(3, VOCAB, (1, 3 * WINDOW + 5), generator=torch.Generator().manual_seed(4))
    whole, parts = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        ref = model(input_ids=ids, **cache_kwargs(model, whole), use_cache=True).logits[:, -1]
    got = chunked_prefill(model, ids, parts, chunk=WINDOW - 3).logits[:, -1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(parts.layers, whole.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)


def test_generate_prefills_a_long_prompt_in_chunks(monkeypatch):
    """`infinigen generate` prefills a prompt longer than PREFILL_CHUNK in chunks through the
    session's cache, then decodes from it: the same tokens as one prefill forward."""
    import infinigen.generation as generation
    from conftest import _byte_tokenizer

    tok = _byte_tokenizer()
    torch.manual_seed(0)
    cfg = _gemma_config(vocab_size=len(tok))
    model = Gemma3ForCausalLM(cfg).eval()
    prompt = "the quick brown fox jumps over the lazy dog " * 2
    config = InfiniGenConfig(policy="full")
    once = generation.run_generation(model, tok, [prompt], config, max_new_tokens=6, progress=False)
    calls = []
    real = generation.chunked_prefill
    monkeypatch.setattr(generation, "PREFILL_CHUNK", WINDOW - 3)
    monkeypatch.setattr(
        generation, "chunked_prefill", lambda *a, **k: calls.append(1) or real(*a, chunk=WINDOW - 3, **k)
    )
    chunked = generation.run_generation(model, tok, [prompt], config, max_new_tokens=6, progress=False)
    assert calls and chunked.token_ids == once.token_ids


def _gemma_config(**changes):
    from conftest import _variant_config

    cfg = _variant_config("gemma3")
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


WINDOWED = {  # policies whose sliding windows may be read back from the tier, and models that have them
    "full": (InfiniGenConfig(policy="full"), HYBRID),
    "infinigen": (SPARSE, ["gemma3", "qwen2-hybrid"]),
}


@pytest.mark.compat
@pytest.mark.parametrize("tier", ["ram", "disk"])
@pytest.mark.parametrize("policy, name", [(p, n) for p, (_, names) in WINDOWED.items() for n in names])
def test_windows_read_from_the_tier_decode_as_kept_windows(tmp_path, policy, name, tier):
    """`windows_on_compute=False`: the sliding layers' KV lives in the tier and each step reads its
    window back: the same tokens and logits as windows kept with the compute (float32 KV, so the
    read is exact), nothing of them kept, and the window's rows counted as read."""
    model = tiny_variant(name)
    ids, mask = _batch()
    base = WINDOWED[policy][0].replace(tier=tier, kv_dir=str(tmp_path), compute_memory=None)
    runs = {}
    for kept in (True, False):
        with attach(model, base.replace(windows_on_compute=kept), progress=False) as session:
            cache = session.new_cache()
            runs[kept] = (_generate(model, ids, mask, cache), cache.summary(), cache.storage.layers)
    (kept_out, kept_s, kept_layers), (out, s, layers) = runs[True], runs[False]
    assert torch.equal(out.sequences, kept_out.sequences)
    for a, b in zip(out.logits, kept_out.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    a = session.adapter
    local = [i for i in range(a.num_layers) if a.is_local(i)]
    assert [p["role"] for p in s["per_layer"] if p["layer"] in local] == ["window"] * len(local)
    assert s["local_kv_bytes"] == 0 == s["memory"]["compute_parts"]["local_layers"]
    assert kept_s["memory"]["compute_parts"]["local_layers"] > 0
    assert layers == kept_layers + len(local)
    per_row = 2 * a.num_kv_heads * a.head_dim * 4  # K and V of one position, float32
    # each of the 7 decode steps reads the last WINDOW - 1 stored positions of every sliding layer
    windows = 7 * (WINDOW - 1) * ids.shape[0] * len(local)
    assert s["bytes_fetched"] - kept_s["bytes_fetched"] == windows * per_row
    fractions = [p["fetched_fraction"] for p in s["per_layer"] if p["layer"] in local]
    assert fractions == pytest.approx([sum((WINDOW - 1) / (ids.shape[1] + k) for k in range(7)) / 7] * len(local))


@pytest.mark.parametrize("name", ["gemma3", "qwen2-hybrid"])
def test_windows_read_from_the_tier_after_a_chunked_prefill(name):
    """A prefill in chunks reads each sliding layer's window back for every chunk after the first
    (under the model's own sliding mask): the same next-token logits as transformers' cache."""
    from infinigen.prefill import chunked_prefill

    model = tiny_variant(name)
    ids = torch.randint(3, VOCAB, (1, 3 * WINDOW + 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(input_ids=ids, **cache_kwargs(model, DynamicCache(config=model.config)), use_cache=True).logits[
            :, -1
        ]
    config = InfiniGenConfig(policy="full", windows_on_compute=False, compute_memory=None)
    with attach(model, config, progress=False) as session, session.new_cache() as cache:
        got = chunked_prefill(model, ids, cache, chunk=WINDOW - 3).logits[:, -1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_windows_are_read_back_only_from_a_tier_that_stores_them_exactly():
    from infinigen.config import ConfigError

    with pytest.raises(ConfigError, match="windows_on_compute=False reads the sliding windows back exactly"):
        InfiniGenConfig(policy="int4", windows_on_compute=False)
    assert InfiniGenConfig(policy="dense", windows_on_compute=False).layer_role(0, local=True) == "local"
