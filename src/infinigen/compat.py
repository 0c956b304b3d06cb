"""What differs between the transformers releases this package admits, answered in one place.

The cache reaches a model's attention as a keyword argument, and its name changed: up to 5.23
it is ``past_key_values``; from 5.24 it is ``cache`` (the old name still accepted by the models'
public calls, with a deprecation warning). A pre-hook that looks for the wrong name silently
sees no cache, and the model then attends whatever the cache's ``update`` returned, without
the session: wrong text, no error. So every place that hands a cache to a model, or finds the
one a model was handed, asks here; the spelling is read from the model's own signature rather
than from a version number.

The declared range (`pyproject.toml`) is the set of releases the exactness tests ran on;
`check_transformers` says in one line when the installed release is outside it.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import Any

import transformers

NEW_NAME = "cache"  # transformers >= 5.24
OLD_NAME = "past_key_values"  # transformers <= 5.23
CACHE_NAMES = (NEW_NAME, OLD_NAME)
DISTRIBUTION = "infinigen-kv"


@functools.cache
def _keyword_of(function: Callable) -> str:
    params = inspect.signature(function).parameters  # follows the deprecation wrapper's __wrapped__
    return NEW_NAME if NEW_NAME in params else OLD_NAME


def cache_keyword(module: Any) -> str:
    """The keyword `module`'s forward takes its cache by ("cache" or "past_key_values")."""
    return _keyword_of(type(module).forward)


def cache_in(kwargs: dict[str, Any]) -> Any:
    """The cache handed in under either spelling (None when there is none)."""
    for name in CACHE_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def with_cache(module: Any, kwargs: dict[str, Any], cache: Any) -> dict[str, Any]:
    """`kwargs` with `cache` under `module`'s own spelling and under no other."""
    rest = {k: v for k, v in kwargs.items() if k not in CACHE_NAMES}
    return {**rest, cache_keyword(module): cache}


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` to call `model` (forward or generate) with, in its own spelling."""
    return {cache_keyword(model): cache}


def cache_of(output: Any) -> Any:
    """The cache a model's output (or `generate`'s dict output) hands back, under either name."""
    for name in CACHE_NAMES:
        value = getattr(output, name, None)
        if value is not None:
            return value
    return None


@functools.cache
def tested_range() -> str | None:
    """The transformers releases this install declares tested (its requirement), if known."""
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    from packaging.requirements import Requirement

    for line in requires:
        req = Requirement(line)
        if req.name == "transformers" and req.marker is None:
            return ",".join(str(s) for s in sorted(req.specifier, key=lambda s: s.operator.startswith("<")))
    return None


def untested_transformers(version: str | None = None, specifier: str | None = None) -> str | None:
    """One sentence when `version` (default: the installed one) is outside the tested range."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = version or transformers.__version__
    specifier = specifier if specifier is not None else tested_range()
    if not specifier or SpecifierSet(specifier).contains(Version(version), prereleases=True):
        return None
    return (
        f"transformers {version} is outside the releases infinigen was tested with ({specifier}): "
        f"install one of them (pip install 'transformers{specifier}') or expect the attach self-check to refuse"
    )


@functools.cache
def check_transformers() -> None:
    """Warn once per process when the installed transformers is outside the tested range."""
    message = untested_transformers()
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=3)
