"""The attach self-check: a session is handed out only when a few positions decoded through its
cache equal the model's own, and a broken interface is refused in one sentence, not run."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
import torch

from conftest import VARIANTS, tiny_model, tiny_variant
from infinigen import InfiniGenConfig, compat
from infinigen.attach import Session
from infinigen.compat import CACHE_NAMES, cache_keyword, untested_transformers
from infinigen.selfcheck import TOLERANCE, SelfCheckError
from infinigen.storage.ram import RamTier
from test_attach import snapshot

pytestmark = pytest.mark.compat  # CI runs these on the newest admitted transformers too

FULL = InfiniGenConfig(policy="full")


@pytest.mark.parametrize("name", ["llama", "opt", *VARIANTS])
def test_every_family_passes_well_inside_the_tolerance(name):
    model = tiny_model(name) if name in ("llama", "opt") else tiny_variant(name)
    with Session(model, FULL) as session:
        # 16-bit stored rows move the logits by about 1e-4 here: the tolerance has a wide margin.
        assert session.check_distance is not None and session.check_distance < TOLERANCE / 20


def test_an_attention_that_bypasses_the_cache_is_refused_and_the_model_left_as_it_was(monkeypatch):
    """What a transformers release that renames the cache keyword does: the hook finds no cache."""
    model = tiny_model("llama")
    before = snapshot(model)
    monkeypatch.setattr(
        sys.modules["infinigen.attach"], "cache_in", lambda kwargs: kwargs.get("a_name_no_release_uses")
    )
    with pytest.raises(SelfCheckError, match=r"self-check failed on transformers .*layers 0, 1, 2, 3 did not go"):
        Session(model, FULL)
    after = snapshot(model)
    assert before.keys() == after.keys() and all(
        torch.equal(v, after["params"][k]) for k, v in before["params"].items()
    )
    assert after["attn"] == before["attn"] and not after["own_generate"]
    monkeypatch.undo()
    Session(model, FULL).detach()  # not left attached


def test_a_broken_row_layout_is_refused_in_one_sentence(monkeypatch):
    """Rows stored with their channels shifted by one (a layout that disagrees with the reader)."""
    store = RamTier._append

    def shifted(self, keys, values, valid):
        return store(self, keys.roll(1, dims=-1), values, valid)

    monkeypatch.setattr(RamTier, "_append", shifted)
    with pytest.raises(SelfCheckError, match=r"gave logits \d+% away from the model's own") as refused:
        Session(tiny_model("qwen2"), FULL)
    assert "\n" not in str(refused.value) and "install a tested transformers release" in str(refused.value)


def test_the_check_can_be_skipped_and_costs_nothing_then():
    with Session(tiny_model("llama"), FULL, check=False) as session:
        assert session.check_distance is None


def test_the_cache_keyword_is_read_from_the_model():
    model = tiny_model("llama")
    name = cache_keyword(model)
    assert name in CACHE_NAMES
    assert cache_keyword(model.model.layers[0].self_attn) == name  # the attention takes what the model takes


def test_the_tested_range_is_what_pyproject_declares():
    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    spec = next(d for d in declared["project"]["dependencies"] if d.startswith("transformers"))
    assert compat.tested_range() is not None and sorted(compat.tested_range().split(",")) == sorted(
        spec[len("transformers") :].split(",")
    )
    assert untested_transformers() is None  # the suite runs on a tested release


def test_an_untested_release_is_named_in_one_line():
    assert untested_transformers("5.25.0", ">=5.23.0,<5.26") is None
    message = untested_transformers("5.26.0", ">=5.23.0,<5.26")
    assert message is not None and "5.26.0" in message and ">=5.23.0,<5.26" in message and "\n" not in message
    assert untested_transformers("5.22.2", ">=5.23.0,<5.26") is not None


def test_a_model_that_passed_is_not_checked_again_until_it_changes():
    model = tiny_model("llama")
    with Session(model, FULL) as first:
        assert first.check_distance is not None
    with Session(model, FULL) as again:
        assert again.check_distance is None  # the same model, as it was: the check is not repeated
    model.to(torch.bfloat16)
    with Session(model, FULL) as changed:
        assert changed.check_distance is not None  # another dtype: checked again
