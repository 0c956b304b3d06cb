"""The plugin inside vLLM (`make test-vllm`; skipped where vLLM is not installed): full fetch gives
vLLM's own greedy tokens, InfiniGen's page lets vLLM fit more blocks at the same KV memory, and a
setting the plugin cannot honour stops the engine with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import USER_CACHE_DIR

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.real]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from transformers import AutoTokenizer
    from infinigen.loading import convert_gguf, smollm2_gguf
    if __name__ == "__main__":
        model = str(convert_gguf(smollm2_gguf(), progress=False))
        ids = AutoTokenizer.from_pretrained(model)(open(sys.argv[1]).read())["input_ids"][:1500]
        args = dict(dtype="float32", enforce_eager=True, max_model_len=1600, enable_prefix_caching=False, seed=0)
        llm = LLM(model=model, **(args | json.loads(sys.argv[2])))
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0, max_tokens=24))
        print("RESULT", json.dumps({"tokens": list(out[0].outputs[0].token_ids),
                                    "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}))
    """
)


def _run(tmp_path, plugin: str | None, **llm_args) -> tuple[int, dict | None, str]:
    import infinigen.data

    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    text = os.path.join(os.path.dirname(infinigen.data.__file__), "areopagitica.txt")
    # The user's cache, not the test's empty one: the plugin finds the model's conversion and its
    # calibration where a run of `make test-vllm` or `infinigen skew` made them (minutes, once).
    env = {k: v for k, v in os.environ.items() if k not in ("INFINIGEN_VLLM", "INFINIGEN_CACHE_DIR")}
    if USER_CACHE_DIR is not None:
        env["INFINIGEN_CACHE_DIR"] = USER_CACHE_DIR
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if plugin is not None:
        env["INFINIGEN_VLLM"] = plugin
    done = subprocess.run(
        [sys.executable, str(script), text, json.dumps(llm_args)], env=env, capture_output=True, text=True, timeout=900
    )
    result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    return done.returncode, result, done.stderr


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    rc, result, err = _run(tmp_path_factory.mktemp("own"), None)
    assert rc == 0, err[-3000:]
    return result


def test_full_fetch_gives_vllms_own_greedy_tokens(tmp_path, own):
    rc, result, err = _run(tmp_path, "policy=full")
    assert rc == 0, err[-3000:]
    assert result["tokens"] == own["tokens"]


def test_infinigen_fits_more_blocks_in_the_same_kv_memory_and_decodes(tmp_path, own):
    rc, result, err = _run(tmp_path, "policy=infinigen")
    assert rc == 0, err[-3000:]
    assert result["blocks"] >= 8 * own["blocks"]
    assert len(result["tokens"]) == 24
    agree = next((j for j, (a, b) in enumerate(zip(result["tokens"], own["tokens"])) if a != b), 24)
    assert agree >= 4, (result["tokens"], own["tokens"])  # the first tokens follow dense's


def test_prefix_caching_is_refused_in_one_line(tmp_path):
    rc, _, err = _run(tmp_path, "policy=infinigen", enable_prefix_caching=True)
    assert rc != 0 and "--no-enable-prefix-caching" in err
