"""The lm-eval model type `infinigen` (`infinigen.integrations.lm_eval`): registered, configured
from model arguments by the config's own rules, and every loglikelihood and generation of an
lm-eval run goes through an InfiniGen cache (its counters say so); with the `full` policy the
scores are plain HFLM's. On the tiny random Llama folder: no download, no calibration of a real
model."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from infinigen.cli_settings import RUN_DEFAULTS  # noqa: E402
from infinigen.config import InfiniGenConfig  # noqa: E402
from infinigen.integrations import lm_eval as integration  # noqa: E402
from infinigen.validation import ConfigError  # noqa: E402

LENGTH = 320  # passkey prompts of 320 tokens (one byte per token): room for the preamble, key and question


def test_the_model_type_is_registered():
    assert get_model("infinigen") is integration.InfiniGenLM


def test_model_arguments_are_config_settings_parsed_by_the_config():
    # lm-eval hands them over typed: "0.25" as 0.25, "true" as True, "none" as None, "{3:2}" as a dict
    cfg = integration.config_from_args(
        {"policy": "quest", "budget": 0.25, "skew": True, "kv_dtype": None, "layer_alpha": {3: 2}, "tier": "disk"}
    )
    assert cfg == InfiniGenConfig(policy="quest", budget=0.25, skew=True, layer_alpha={3: 2.0}, tier="disk")
    assert integration.config_from_args({}).kv_dtype == RUN_DEFAULTS["kv_dtype"]  # the commands' defaults
    with pytest.raises(ConfigError, match="unknown setting 'budgte'"):
        integration.config_from_args({"budgte": 0.1})
    with pytest.raises(ConfigError, match="budget"):
        integration.config_from_args({"budget": 2})


def test_an_lm_eval_run_decodes_through_the_infinigen_cache(tiny_model_dir):
    args = dict(pretrained=str(tiny_model_dir), policy="infinigen", budget=0.25, calibration_tokens=64, tier="disk")
    # The tasks read their tokenizer from the metadata (the CLI merges the model arguments into it)
    metadata = {"pretrained": args["pretrained"], "max_seq_lengths": [LENGTH], "samples": 2}
    tasks = TaskManager(include_path=str(integration.TASKS_DIR), include_defaults=False, metadata=metadata)
    out = simple_evaluate(
        model="infinigen",
        model_args=args,
        tasks=["infinigen_passkey", "infinigen_passkey_gen"],
        task_manager=tasks,
        limit=2,
        bootstrap_iters=0,
        log_samples=False,
    )
    info = out["config"]["infinigen"]
    assert info["config"]["policy"] == "infinigen" and info["config"]["tier"] == "disk"
    ll, gen = info["cache"]["loglikelihood"], info["cache"]["generate_until"]
    # loglikelihood: one cache per request, the prompt prefilled, the key's tokens but the first decoded
    assert ll["caches"] == 2 and ll["prefill_tokens"] == 2 * LENGTH
    assert ll["decode_tokens"] == 2 * (len(" 12345") - 1)  # one token per byte
    assert gen["caches"] == 2 and gen["decode_tokens"] > 0
    for counters in (ll, gen):
        assert 0 < counters["fetched_fraction"] < 1 and counters["bytes_fetched"] > 0
    assert set(out["results"]) == {"infinigen_passkey", "infinigen_passkey_gen"}


def _requests() -> list[Instance]:
    pairs = [("The grass is green. The sky is", " blue. The sun is yellow."), ("Here we go", ". There and back again.")]
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


@pytest.mark.parametrize("policy", ["full", "dense"])
def test_loglikelihoods_equal_plain_hflm_without_selection(tiny_model_dir, policy):
    plain = HFLM(pretrained=str(tiny_model_dir), device="cpu", dtype="float32").loglikelihood(_requests())
    lm = integration.InfiniGenLM(pretrained=str(tiny_model_dir), device="cpu", policy=policy, kv_dtype="none")
    try:
        ours = lm.loglikelihood(_requests())
    finally:
        lm.close()
    for (a, greedy_a), (b, greedy_b) in zip(plain, ours):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-4) and greedy_a == greedy_b
    counters = lm.totals["loglikelihood"].as_dict()
    assert counters["caches"] == 2 and counters["decode_tokens"] > 0
    assert counters["fetched_fraction"] == (1.0 if policy == "full" else None)
