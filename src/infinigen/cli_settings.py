"""The settings on the command line, derived from `InfiniGenConfig`'s fields, never listed by hand
(each selector's knobs among them: declared in its file in `infinigen.select`, they reach the
config through the selectors' registry, and from there every flag, `--set` key and docs row).

Every setting is a ``--flag`` of `generate`, `demo`, `skew` and `bench decode` (`add_arguments`)
and a ``KEY=VALUE`` of `eval --set` (`parse_setting`); `from_arguments` builds the config of the
flags a user gave over a command's own defaults. User settings and research switches (the knobs
marked ``advanced``) are shown in two groups, so that `--help` leads with the few a user chooses.
`settings_table` is docs/settings.md's table, from the same fields.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from infinigen.config import (
    InfiniGenConfig,
    advanced_settings,
    setting_default,
    setting_fields,
    setting_type,
)
from infinigen.validation import ConfigError, parse_text

# What the commands that run a model store their KV in by default (the library keeps the
# compute dtype): 16-bit storage, compute in fp32.
RUN_DEFAULTS: dict[str, Any] = {"kv_dtype": "float16"}
# demo and bench decode: the same, with the KV on disk (the slow tier the method is for).
DISK_DEFAULTS: dict[str, Any] = {**RUN_DEFAULTS, "tier": "disk"}

USER_GROUP = "settings (InfiniGenConfig; 'default' restores a default, 'none' unsets an optional setting)"
ADVANCED_GROUP = "advanced (research) settings: defaults are calibrated; change them to study the method"
# A field's help that says its default in its own words, at its end: "(default ...)", "; default: ...".
OWN_DEFAULT = re.compile(r"\s*(\(default[^()]*\)|;\s*default:[^;]*)$")


def parse_setting(name: str, text: str) -> Any:
    """A setting's value from text (a CLI flag, `--set KEY=VALUE`); ConfigError names the
    setting, what it takes, and the valid keys for an unknown one."""
    known = setting_fields()
    if name not in known:
        raise ConfigError(f"unknown setting {name!r}; known: {', '.join(known)}")
    if text.strip().lower() == "default":
        return setting_default(name)
    return parse_text(name, setting_type(name), text)


def _shown(value: Any) -> str:
    """A default as a user would type it."""
    if isinstance(value, dict):
        return ",".join(f"{k}:{v:g}" for k, v in value.items()) or "none"
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def flag_help(name: str, default: Any) -> str:
    """A setting's help with one default: the field's own words about it when the command keeps
    the library's, else `default`, shown as typed (a command's own default replaces the words)."""
    text = setting_fields()[name].metadata["help"]
    if "default" in text and default == setting_default(name):
        return text
    return f"{OWN_DEFAULT.sub('', text)} (default: {_shown(default)})"


def add_arguments(
    parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None, skip: tuple[str, ...] = ()
) -> None:
    """One ``--flag`` per setting (``--name-with-dashes``; booleans also ``--no-...``), with the
    field's help and rule; `defaults` are a command's own defaults. Only the flags given end up
    in the parsed namespace, so `from_arguments` knows what the user set."""
    defaults = defaults or {}
    advanced = advanced_settings()
    user_group = parser.add_argument_group(USER_GROUP)
    advanced_group = parser.add_argument_group(ADVANCED_GROUP)
    for name in setting_fields():
        if name in skip:
            continue
        group = advanced_group if name in advanced else user_group
        text = flag_help(name, defaults.get(name, setting_default(name))).replace("%", "%%")  # argparse formats help
        flag = "--" + name.replace("_", "-")
        if setting_type(name) is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        else:

            def parse(value: str, name=name):
                try:
                    return parse_setting(name, value)
                except ConfigError as exc:
                    raise argparse.ArgumentTypeError(str(exc)) from None

            group.add_argument(flag, type=parse, default=argparse.SUPPRESS, metavar="X", help=text)


def from_arguments(args: argparse.Namespace, defaults: dict[str, Any] | None = None, **fixed: Any) -> InfiniGenConfig:
    """The config of parsed flags: `fixed` over the flags given over the command's `defaults`."""
    given = {name: getattr(args, name) for name in setting_fields() if hasattr(args, name)}
    return InfiniGenConfig(**{**(defaults or {}), **given, **fixed})


def settings_table() -> str:
    """docs/settings.md's table: every setting, user settings first, with its library default,
    its kind and what it means (its help, the text `--help` shows)."""
    advanced = advanced_settings()
    names = [n for n in setting_fields() if n not in advanced] + list(advanced)
    rows = ["| setting | default | kind | meaning |", "| --- | --- | --- | --- |"]
    for name in names:
        kind = "advanced" if name in advanced else "user"
        meaning = setting_fields()[name].metadata["help"].replace("|", "\\|")
        rows.append(f"| `{name}` | `{_shown(setting_default(name))}` | {kind} | {meaning} |")
    return "\n".join(rows)


def settings_markdown() -> str:
    """docs/settings.md, whole: written from the config (`python -m infinigen.cli_settings >
    docs/settings.md`), and a test holds the file to it."""
    commands = ", ".join(f"{k}={_shown(v)}" for k, v in RUN_DEFAULTS.items())
    disk = ", ".join(f"{k}={_shown(v)}" for k, v in DISK_DEFAULTS.items())
    return f"""# Settings

Every setting of `InfiniGenConfig`, generated from its fields (`python -m infinigen.cli_settings >
docs/settings.md`; `tests/test_config.py` fails when this file and the config differ). Each is a
keyword of `InfiniGenConfig(...)`, a `--flag-with-dashes` of `infinigen generate`, `demo`, `skew`
and `bench decode` (booleans also `--no-...`), and a `KEY=VALUE` of `infinigen eval --set`; `default`
restores a setting's default and `none` unsets an optional one.

**user** settings are what a user chooses: the policy and its budget, where the KV lives and in
what dtype, the host pool, threads. **advanced** settings are research switches: the method's and
the baselines' knobs, whose defaults are calibrated (docs/results.md); change them to study the
method. `--help` lists them in a group of their own.

The default is the library's. The commands that run a model store the KV in 16 bits
({commands}); `demo` and `bench decode` also put it on disk ({disk}).

{settings_table()}
"""


if __name__ == "__main__":
    print(settings_markdown(), end="")
