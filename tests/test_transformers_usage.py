"""Everyday Hugging Face usage inside `attach`: each behaviour runs on the InfiniGen cache (its
counters move) and gives what the unmodified model gives (the `full` policy fetches every row,
so it is exact), or is refused in one sentence before any prefill. See docs/usage.md."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch
from transformers import (
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    StoppingCriteria,
    TextIteratorStreamer,
    TextStreamer,
    pipeline,
)

from conftest import open_files_in, require_default_model
from infinigen import ContextTooLongError, InfiniGenConfig, attach
from infinigen.cache import CacheClosedError
from infinigen.compat import CACHE_NAMES, cache_kwargs, cache_of
from infinigen.generate_guard import UnsupportedGenerationError

pytestmark = pytest.mark.compat  # CI runs these on the newest admitted transformers too

FULL = InfiniGenConfig(policy="full")
CONTEXT = 256  # the tiny model's positions
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TURN = (
    "<|im_end|>\n<|im_start|>user\nThank you. And what is the capital of Italy, how far is it from Paris "
    "by train, which river runs through it, how many people live there, which of its buildings are the "
    "oldest, and what would you see first on a short visit in spring, when the weather is mild and the "
    "days are getting longer?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer (chat template, stop strings, streamers), from the converted model folder."""
    require_default_model()
    from infinigen.loading import resolve_model_folder

    return AutoTokenizer.from_pretrained(str(resolve_model_folder(None, progress=False)))


@pytest.fixture(scope="module")
def model(tok):
    """A tiny random Llama over SmolLM2's vocabulary: fast, and every token decodes to text."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def enc(tok):
    return tok(["The quick brown fox jumps over the lazy dog and"], return_tensors="pt")


def moved(session, steps: int) -> dict:
    """The summary of the session's last cache, after checking it decoded `steps` steps from its tier."""
    summary = session.last_cache.summary()
    assert summary["decode_steps"] == steps and summary["bytes_fetched"] > 0, summary
    return summary


def test_pipeline_text_generation(model, tok):
    kw = dict(max_new_tokens=6, do_sample=False)
    want = pipeline("text-generation", model=model, tokenizer=tok)("Once upon a time", **kw)
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        got = pipeline("text-generation", model=model, tokenizer=tok)("Once upon a time", **kw)
        moved(session, 5)  # the first token comes from the prefill
    assert got == want


def test_sampling_with_temperature_and_top_p(model, tok, enc):
    kw = dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=8)
    torch.manual_seed(3)
    want = model.generate(**enc, **kw)
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        torch.manual_seed(3)
        got = model.generate(**enc, **kw)
        moved(session, 7)
    assert torch.equal(got, want)


def test_text_streamer(model, tok, enc, capsys):
    model.generate(**enc, streamer=TextStreamer(tok, skip_prompt=True), max_new_tokens=8, do_sample=False)
    want = capsys.readouterr().out
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        model.generate(**enc, streamer=TextStreamer(tok, skip_prompt=True), max_new_tokens=8, do_sample=False)
        moved(session, 7)
    assert capsys.readouterr().out == want and want.strip()


def test_text_iterator_streamer_from_a_thread(model, tok, enc):
    def stream() -> str:
        streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)  # a failure must not hang the test
        kw = dict(**enc, streamer=streamer, max_new_tokens=8, do_sample=False)
        thread = threading.Thread(target=model.generate, kwargs=kw)
        thread.start()
        text = "".join(streamer)
        thread.join()
        return text

    want = stream()
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        got = stream()
        moved(session, 7)
    assert got == want and want.strip()


def test_return_dict_in_generate_with_scores(model, tok, enc):
    kw = dict(return_dict_in_generate=True, output_scores=True, max_new_tokens=6, do_sample=False)
    want = model.generate(**enc, **kw)
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        got = model.generate(**enc, **kw)
        assert cache_of(got) is session.last_cache and not cache_of(got).closed  # handed back open
        moved(session, 5)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores, strict=True):  # float32 rounding: the rows sit in other buffers
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chat_template(model, tok):
    enc = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    want = model.generate(**enc, max_new_tokens=6, do_sample=False)
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        got = model.generate(**enc, max_new_tokens=6, do_sample=False)
        moved(session, 5)
    assert torch.equal(got, want)


def test_stop_strings(model, tok, enc):
    n = enc.input_ids.shape[1]
    free = model.generate(**enc, max_new_tokens=12, do_sample=False)[0, n:]
    stop = tok.decode(free[4:5]).strip() or tok.decode(free[4:6])  # a string the model writes at step 5
    kw = dict(stop_strings=[stop], tokenizer=tok, max_new_tokens=12, do_sample=False)
    want = model.generate(**enc, **kw)
    assert want.shape[1] - n <= 6  # the stop string ended it
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        got = model.generate(**enc, **kw)
        moved(session, want.shape[1] - n - 1)
    assert torch.equal(got, want)


def test_num_return_sequences(model, tok, enc):
    kw = dict(do_sample=True, num_return_sequences=3, max_new_tokens=6)
    torch.manual_seed(5)
    want = model.generate(**enc, **kw)
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        torch.manual_seed(5)
        got = model.generate(**enc, **kw)
        assert moved(session, 5)["batch"] == 3
    assert torch.equal(got, want) and want.shape[0] == 3


def test_uneven_batch_with_left_padding(model, tok):
    prompts = ["Hi", "The quick brown fox jumps over the lazy dog", "One two three"]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    assert not bool(enc.attention_mask.all())
    kw = dict(max_new_tokens=6, do_sample=False)
    want = model.generate(**enc, **kw)
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        got = model.generate(**enc, **kw)
        assert moved(session, 5)["batch"] == 3
    assert torch.equal(got, want)


def two_turns(model, tok, cache=None):
    """A chat turn, then a longer new user turn continued on the first turn's cache: (the first
    output, the second output). `cache`: the first turn's cache (default: the session's own)."""
    enc = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    kw = dict(return_dict_in_generate=True, max_new_tokens=5, do_sample=False)
    first = model.generate(**enc, **cache_kwargs(model, cache), **kw)
    turn = tok(NEW_TURN, return_tensors="pt").input_ids
    assert turn.shape[1] > 2 * enc.input_ids.shape[1]  # the cache must grow past what the first turn needed
    ids = torch.cat([first.sequences, turn], 1)
    return first, model.generate(input_ids=ids, **cache_kwargs(model, cache_of(first)), **kw)


@pytest.mark.parametrize("policy", ["full", "infinigen"])
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_multi_turn_continuation(model, tok, policy, tier, tmp_path):
    _, want = two_turns(model, tok, DynamicCache(config=model.config))
    # the spread and correction given: calibration skips measuring them (seconds, not tens)
    fixed = dict(allocation="uniform", correction=0.02) if policy == "infinigen" else {}
    cfg = InfiniGenConfig(policy=policy, tier=tier, kv_dir=str(tmp_path), calibration_tokens=64, **fixed)
    with attach(model, cfg, tokenizer=tok, progress=False) as session:
        first, got = two_turns(model, tok)
        cache = session.last_cache
        assert cache_of(got) is cache and cache_of(first) is cache
        summary = cache.summary()
        assert summary["decode_steps"] == 8  # 4 per turn: each turn's first token comes from a forward of many
        assert summary["prefill_tokens"] + 8 == got.sequences.shape[1] - 1  # every position but the last token's
        assert summary["bytes_fetched"] > 0
        assert summary["fetched_fraction"] == 1.0 if policy == "full" else 0 < summary["fetched_fraction"] < 1
    assert cache.closed and not open_files_in(tmp_path)  # detach released it
    if policy == "full":  # every row fetched: exact
        assert torch.equal(got.sequences, want.sequences)
    else:  # selected rows: the continuation runs and has its tokens
        assert got.sequences.shape == want.sequences.shape


@pytest.mark.parametrize("keyword", CACHE_NAMES)
def test_a_cache_handed_to_generate_under_either_name_is_used_without_a_warning(model, tok, enc, keyword):
    """transformers 5.24 renamed `past_key_values` to `cache`: inside attach, generate takes an
    InfiniGen cache under either name on every admitted release, and says nothing about it."""
    kw = dict(max_new_tokens=4, do_sample=False)
    want = model.generate(**enc, **kw)
    with attach(model, FULL, tokenizer=tok, progress=False) as session, session.new_cache() as cache:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = model.generate(**enc, **{keyword: cache}, **kw)
        assert cache.summary()["decode_steps"] == 3
    assert torch.equal(got, want)


class _Boom(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise RuntimeError("boom")


@pytest.mark.parametrize("how", ["close", "with", "detach", "returned", "failed"])
def test_a_closed_cache_says_so_when_used_again(model, tok, enc, how):
    kw = dict(max_new_tokens=3, do_sample=False)
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        if how == "close":
            cache = session.new_cache()
            model.generate(**enc, **cache_kwargs(model, cache), **kw)
            cache.close()
        elif how == "with":
            with session.new_cache() as cache:
                model.generate(**enc, **cache_kwargs(model, cache), **kw)
        elif how == "detach":
            cache = cache_of(model.generate(**enc, return_dict_in_generate=True, **kw))
        elif how == "returned":
            model.generate(**enc, **kw)
            cache = session.last_cache
        else:
            with pytest.raises(RuntimeError, match="boom"):
                model.generate(**enc, stopping_criteria=[_Boom()], **kw)
            cache = session.last_cache
        if how != "detach":
            with pytest.raises(CacheClosedError, match=r"^this InfiniGen cache is closed .*start a new generation"):
                model.generate(**enc, **cache_kwargs(model, cache), **kw)
    reason = {"close": "close", "with": "with", "detach": "detached", "returned": "return_dict", "failed": "failed"}
    with pytest.raises(CacheClosedError, match=f"released when .*{reason[how]}"):
        model(**enc, **cache_kwargs(model, cache))  # a plain forward too, the session gone
    assert cache.summary()["decode_steps"] == (0 if how == "failed" else 2)  # its counters stay


def test_a_dropped_output_releases_its_cache(model, tok, enc, tmp_path):
    """The cache handed back is released when the output goes: nothing holds it in a cycle."""
    with attach(model, FULL.replace(tier="disk", kv_dir=str(tmp_path)), tokenizer=tok, progress=False) as session:
        out = model.generate(**enc, return_dict_in_generate=True, max_new_tokens=3, do_sample=False)
        ref = weakref.ref(cache_of(out))
        assert open_files_in(tmp_path)
        gc.disable()  # freed by reference counting alone, or not at all
        try:
            del out
            assert ref() is None and session.last_cache is None
        finally:
            gc.enable()
        assert not open_files_in(tmp_path)


REFUSED = {
    "beam search": (dict(num_beams=2), "beam search.*greedy decoding or sampling"),
    "beam search (config)": (
        dict(generation_config=GenerationConfig(num_beams=2, max_new_tokens=4)),
        "beam search.*num_beams=1",
    ),
    "assisted": (dict(assistant_model="self"), "assisted decoding.*without an assistant"),
    "prompt lookup": (dict(prompt_lookup_num_tokens=3), "prompt lookup.*without prompt_lookup_num_tokens"),
    "contrastive": (dict(penalty_alpha=0.6, top_k=4), "contrastive search.*greedy decoding or sampling"),
    "attentions": (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions.*eager"),
    "too long": (dict(max_new_tokens=CONTEXT), "exceed the model's context of 256.*lower max_new_tokens"),
    "max_length": (dict(max_length=CONTEXT + 1, max_new_tokens=None), "max_length.*lower max_length"),
    "use_cache=False on a cache": (dict(use_cache=False, past_key_values="cache"), "use_cache=False.*leave use_cache"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refused_before_any_prefill(model, tok, enc, name):
    kwargs, message = REFUSED[name]
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        made = {"self": model, "cache": session.new_cache()}
        kwargs = {k: made.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
        forwards = []
        hook = model.register_forward_pre_hook(lambda *a: forwards.append(1))
        try:
            with pytest.raises((UnsupportedGenerationError, ContextTooLongError), match=message) as refused:
                model.generate(**enc, **{"max_new_tokens": 4, "do_sample": False, **kwargs})
        finally:
            hook.remove()
        assert not forwards and session.last_cache is None  # nothing ran, no cache was made
    assert "\n" not in str(refused.value)


def test_use_cache_false_runs_the_plain_model(model, tok, enc):
    kw = dict(use_cache=False, max_new_tokens=4, do_sample=False)
    want = model.generate(**enc, **kw)
    with attach(model, FULL, tokenizer=tok, progress=False) as session:
        got = model.generate(**enc, **kw)
        assert session.last_cache is None  # no cache, nothing to offload
    assert torch.equal(got, want)
