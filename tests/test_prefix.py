"""A prompt prefilled once and replayed into a cache (`prefill.Prefix`) generates what the
cache's own prefill does, for every policy whose prefill attends densely; the rest are refused."""

from __future__ import annotations

import pytest
import torch

from conftest import WINDOW, _byte_tokenizer, _variant_config
from infinigen import InfiniGenConfig
from infinigen.errors import InputError
from infinigen.generation import prompt_column_sums, run_generation
from infinigen.models import get_adapter
from infinigen.prefill import dense_prefix


def _model(family: str, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gemma3":
        from transformers import Gemma3ForCausalLM

        cfg = _variant_config("gemma3")
        cfg.vocab_size = vocab
        return Gemma3ForCausalLM(cfg).eval()
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


PROMPT = "the quick brown fox jumps over the lazy dog; " * 3  # longer than the sliding window


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("policy", ["dense", "full", "infinigen", "h2o"])
def test_a_replayed_prefix_generates_what_the_prefill_does(family, policy):
    """H2O watches its prefill's attention: its prefix carries the prompt's column sums."""
    tok = _byte_tokenizer()
    model = _model(family, len(tok))
    config = InfiniGenConfig(policy=policy, budget=0.3, calibration_tokens=64)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids.shape[1] > WINDOW
    own = run_generation(model, tok, [PROMPT] * 2, config, max_new_tokens=6, progress=False)
    prefix = dense_prefix(model, ids)
    assert prefix.length == ids.shape[1]
    if policy == "h2o":
        prefix.column_sums = prompt_column_sums(model, ids)
        assert set(prefix.column_sums) == set(get_adapter(model).global_layers)
    replayed = run_generation(model, tok, [PROMPT] * 2, config, max_new_tokens=6, progress=False, prefix=prefix)
    assert replayed.token_ids == own.token_ids
    assert replayed.token_ids[0] == replayed.token_ids[1]
    assert replayed.summary["dense_kv_bytes"] == own.summary["dense_kv_bytes"]
    parts, own_parts = replayed.summary["memory"]["compute_parts"], own.summary["memory"]["compute_parts"]
    assert {k: v for k, v in parts.items() if k != "metadata"} == {
        k: v for k, v in own_parts.items() if k != "metadata"
    }
    assert abs(parts["metadata"] - own_parts["metadata"]) <= 16  # the position bookkeeping, stored in one piece
    for key in ("prefill_tokens", "decode_steps", "bytes_fetched"):
        assert replayed.summary[key] == own.summary[key]


def test_a_prefix_of_other_tokens_or_for_a_policy_that_watches_the_prefill_is_refused():
    tok = _byte_tokenizer()
    model = _model("llama", len(tok))
    ids = tok(PROMPT, return_tensors="pt").input_ids
    prefix = dense_prefix(model, ids)
    other = PROMPT.replace("fox", "cat")
    with pytest.raises(InputError, match="other tokens"):
        run_generation(model, tok, [other], InfiniGenConfig(policy="full"), max_new_tokens=2, progress=False,
                       prefix=prefix)  # fmt: skip
    with pytest.raises(InputError, match="other tokens"):
        run_generation(model, tok, [PROMPT + "!"], InfiniGenConfig(policy="full"), max_new_tokens=2, progress=False,
                       prefix=prefix)  # fmt: skip
    with pytest.raises(InputError, match="h2o reads the prefill's attention"):
        run_generation(model, tok, [PROMPT], InfiniGenConfig(policy="h2o"), max_new_tokens=2, progress=False,
                       prefix=prefix)  # fmt: skip
    with pytest.raises(ValueError, match="one row"):
        dense_prefix(model, ids.expand(2, -1))


def test_the_demo_decodes_a_batch_from_one_prefill_and_reports_on_one_scale(tiny_model_dir, capsys, monkeypatch):
    """`infinigen demo` end to end on a tiny model: four policies over a batch from one prefill,
    full fetch's rows the same tokens as dense, and what each keeps as a share of dense's 16-bit
    KV (dense's own fp32 KV is twice that)."""
    import re

    import infinigen.prefill as prefill
    from infinigen.cli import main

    calls = []
    real = prefill.dense_prefix
    monkeypatch.setattr(prefill, "dense_prefix", lambda *a, **k: calls.append(1) or real(*a, **k))
    argv = ["demo", "--model", str(tiny_model_dir), "--prompt-tokens", "300", "--max-new-tokens", "4"]
    assert main([*argv, "--batch", "2", "--quiet", "--calibration-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert calls == [1]  # one prefill for every policy
    rows = {
        m.group(1): m
        for m in re.finditer(r"^\s*(dense|full|h2o|infinigen) .*?([\d.]+) MiB = (\d+)%\s+first (\d) of 4", out, re.M)
    }
    assert set(rows) == {"dense", "full", "h2o", "infinigen"}
    assert "H2O with the prompt's attention column sums" in out
    assert rows["dense"].group(4) == rows["full"].group(4) == "4"  # full fetch is exact
    assert 190 <= int(rows["dense"].group(3)) <= 210  # fp32 as computed against dense's fp16 KV
    # InfiniGen aims at 12.5 % of dense's KV by default; a tiny model's buffers outweigh its KV, so
    # the aim is missed and said so; the last row runs without the aim, for comparison
    line = next(x for x in out.splitlines() if x.startswith("infinigen: "))
    assert "aiming at 12.5% of dense's KV = " in line and "not met: at least" in line
    assert re.search(r"^\s*ig no budget +disk tier, [\d.]+% read .*?MiB = \d+%\s+first \d of 4", out, re.M), out
    assert "ig no budget: the same with --compute-memory none: no budget, nothing given up" in out


def test_the_demo_runs_infinigen_again_with_the_aim_or_within_a_budget_given(tiny_model_dir, capsys):
    """With `--compute-memory none` the last row runs InfiniGen with the default aim; with a
    budget of its own, InfiniGen is planned within it and there is no last row."""
    import re

    import infinigen.cli as cli

    argv = ["demo", "--model", str(tiny_model_dir), "--prompt-tokens", "300", "--max-new-tokens", "4", "--batch", "2"]
    assert cli.main([*argv, "--quiet", "--calibration-tokens", "64", "--compute-memory", "none"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s*ig auto +disk tier, [\d.]+% read .*?MiB = \d+%\s+first \d of 4", out, re.M), out
    assert "infinigen: no compute_memory budget" in out
    assert "ig auto: the same with --compute-memory auto: aiming at 12.5% of dense's KV" in out
    assert cli.main([*argv, "--quiet", "--calibration-tokens", "64", "--compute-memory", "400%"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^\s*infinigen +disk tier, [\d.]+% read .*?([\d.]+) MiB = (\d+)%\s+first (\d) of 4", out, re.M)
    assert row is not None and int(row.group(2)) <= 400, out
    assert "infinigen: within compute_memory 400% of dense's KV = " in out and not re.search(r"^\s*ig ", out, re.M)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_h2o_replayed_a_prefix_accumulates_the_prompts_attention_as_its_own_prefill_does(family):
    """The column sums a prefix carries are what H2O's own prefill accumulates, layer by layer
    (the greedy tokens above can agree by chance; the accumulated attention cannot)."""
    from infinigen import attach
    from infinigen.compat import cache_kwargs

    tok = _byte_tokenizer()
    model = _model(family, len(tok))
    ids = tok(PROMPT, return_tensors="pt").input_ids
    prefix = dense_prefix(model, ids)
    prefix.column_sums = prompt_column_sums(model, ids)
    with attach(model, InfiniGenConfig(policy="h2o", budget=0.3), progress=False) as session:
        with session.new_cache() as own, session.new_cache() as replayed:
            model(input_ids=ids, **cache_kwargs(model, own), use_cache=True)
            prefix.replay(replayed, 1)
            accumulated = [
                (a.selecting.state.acc, b.selecting.state.acc)
                for a, b in zip(own.layers, replayed.layers)
                if getattr(a, "selecting", None) is not None
            ]
    assert accumulated  # the layers that select (the first keep their KV with the compute)
    for mine, theirs in accumulated:
        assert mine.abs().sum() > 0
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
