"""How a setting states its rule, and how a value is checked against it.

A setting is a dataclass field made with `knob`: its default, its help text, its `Rule` (what a
value must satisfy beyond its type) and whether it is a research switch (`advanced`). A dataclass
that derives from `Validated` checks every field against its annotation and rule when it is
built, so a bad value fails before any work starts. Text (a command-line flag, `--set KEY=VALUE`)
becomes a typed value with `parse_text`. This module declares no setting: `infinigen.config`
and each selector's file (`infinigen.select`) do.
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from infinigen.errors import InfiniGenError


class ConfigError(InfiniGenError, ValueError):
    """An invalid configuration value (raised before any work starts)."""


@dataclass(frozen=True)
class Rule:
    """What a value must satisfy beyond its type, and how to say it."""

    text: str
    ok: Callable[[Any], bool]


def fraction(low_open: bool = True) -> Rule:
    """A fraction of something: (0, 1], or [0, 1] when zero means "off"."""
    if low_open:
        return Rule("a fraction in (0, 1]", lambda v: 0 < v <= 1)
    return Rule("a fraction in [0, 1]", lambda v: 0 <= v <= 1)


def at_least(n: float, what: str = "") -> Rule:
    """A lower bound; `what` says what the bound means where a number alone would not."""
    return Rule(f">= {n:g}{what}", lambda v: v >= n)


def one_of(choices: tuple) -> Rule:
    """A choice among names; the message lists them, so a typo says what would have worked."""
    return Rule(f"one of {', '.join(map(str, choices))}", lambda v: v in choices)


def knob(default: Any, help: str, rule: Rule | None = None, advanced: bool = False) -> Any:
    """A config field: its default, its help text (CLI), its rule (validation) and whether it is
    a research switch (`advanced`: its default is calibrated; the CLI shows it apart)."""
    meta = {"help": help, "rule": rule, "advanced": advanced}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Validated:
    """Checks every field against its annotation and rule at construction."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if not type_ok(value, hints[f.name]):
                raise ConfigError(f"{f.name} must be {type_text(hints[f.name])}, got {value!r}")
            rule = f.metadata.get("rule")
            if rule is not None and value is not None and not rule.ok(value):
                raise ConfigError(f"{f.name} must be {rule.text}, got {value!r}")


# ---------------------------------------------------------------------- types and text
def optional_inner(hint: Any) -> tuple[Any, bool]:
    """(the type inside ``X | None``, whether None is allowed)."""
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def type_ok(value: Any, hint: Any) -> bool:
    """Whether `value` is of the annotated type, strictly: a bool is no number, NaN no float."""
    inner, optional = optional_inner(hint)
    if value is None:
        return optional
    if inner is bool:
        return isinstance(value, bool)
    if inner is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if inner is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if inner is str:
        return isinstance(value, str)
    if typing.get_origin(inner) is dict:
        return isinstance(value, dict) and all(type_ok(k, int) and type_ok(v, float) for k, v in value.items())
    return True


def type_text(hint: Any) -> str:
    """The annotated type in words, for a message."""
    inner, optional = optional_inner(hint)
    text = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        inner, "a map of integers to numbers"
    )
    return text + (" or None" if optional else "")


_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def parse_text(name: str, hint: Any, text: str) -> Any:
    """The value of setting `name` (annotated `hint`) written as text; ConfigError names the
    setting and what it takes. Only the type is read here: the rule is checked when the config
    is built."""
    inner, optional = optional_inner(hint)
    text = text.strip()
    if optional and text.lower() in ("none", "null", "default"):
        return None
    try:
        if inner is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(text)
            return text.lower() in _TRUE
        if inner is int:
            return int(text)
        if inner is float:
            return float(text)
        if typing.get_origin(inner) is dict:
            out = {}
            for item in filter(None, (p.strip() for p in text.split(","))):
                key, _, value = item.partition(":")
                out[int(key)] = float(value)
            return out
    except ValueError:
        raise ConfigError(f"{name} takes {type_text(hint)}, got {text!r}") from None
    return text


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}  # fmt: skip


def parse_size(text: str | int) -> int:
    """Bytes from '512MiB', '1.5G', '800 MB' or a plain number (binary units for K, M, G, T)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 512MiB, 1GiB, 800M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def size() -> Rule:
    """A positive size in bytes, written as `parse_size` reads it."""

    def ok(v) -> bool:
        try:
            return parse_size(v) > 0
        except ValueError:
            return False

    return Rule("a size such as 512MiB, 1GiB or 800M (a plain number: bytes)", ok)


def parse_share(text: str | int) -> float | None:
    """The fraction a text such as '12.5%' names (0.125); None when it is not a percentage."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*%\s*", str(text))
    return None if m is None else float(m.group(1)) / 100


def resolve_size(text: str | int, whole: int) -> int:
    """Bytes from a size (`parse_size`) or a share of `whole` ('12.5%': an eighth of it)."""
    share = parse_share(text)
    return parse_size(text) if share is None else int(share * whole)


def size_or_share() -> Rule:
    """A positive size in bytes, or a positive percentage of a whole the setting names."""

    sizes = size()

    def ok(v) -> bool:
        share = parse_share(v)
        return share > 0 if share is not None else sizes.ok(v)

    return Rule(f"{sizes.text}, or a share such as 12.5%", ok)
