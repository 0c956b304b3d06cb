"""What the vLLM plugin runs, from one environment variable that every vLLM process inherits.

``INFINIGEN_VLLM="policy=infinigen,budget=0.1"`` turns the plugin on (unset: installing this
package next to vLLM changes nothing). The keys are `InfiniGenConfig`'s settings, parsed and
validated as the command line's are (`infinigen.cli_settings.parse_setting`), plus ``artifact=PATH``
(a skew artifact; default: the one calibrated for the model vLLM loads, made once if missing).
What the plugin cannot honour is refused here, in one line, before vLLM sizes anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from infinigen.cli_settings import parse_setting
from infinigen.config import InfiniGenConfig
from infinigen.errors import InputError

ENV = "INFINIGEN_VLLM"
# What the plugin runs: the method, its full-fetch reference, and the true top-k at the same budget
# (the bound quality is measured against; it reads every key to choose).
POLICIES = ("infinigen", "full", "oracle")
PAGE_FORMAT = "int4"  # the partial keys vLLM's page holds (`infinigen.select.quantized`)


class PluginSettingsError(InputError):
    """A setting the vLLM plugin cannot honour, or one that does not parse."""


@dataclass(frozen=True)
class PluginSettings:
    config: InfiniGenConfig
    artifact: Path | None = None

    @property
    def selects(self) -> bool:
        """Whether the layers past the dense ones attend a selection (else every row)."""
        return self.config.spec.selector is not None

    @property
    def keeps_partial_keys(self) -> bool:
        """Whether vLLM's page holds partial keys (InfiniGen's speculation state), else a placeholder."""
        return self.config.spec.selector == "infinigen"


def parse(text: str) -> PluginSettings:
    """``key=value`` pairs separated by commas (a value may not hold a comma)."""
    values: dict = {}
    artifact = None
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq:
            raise PluginSettingsError(f"{ENV}: {item!r} is not KEY=VALUE")
        if key == "artifact":
            artifact = Path(value.strip()).expanduser()
            continue
        try:
            values[key] = parse_setting(key, value.strip())
        except ValueError as exc:
            raise PluginSettingsError(f"{ENV}: {exc}") from None
    values.setdefault("policy", "infinigen")
    try:
        config = InfiniGenConfig(**values)
    except ValueError as exc:
        raise PluginSettingsError(f"{ENV}: {exc}") from None
    _check(config)
    if artifact is not None and not artifact.is_file():
        raise PluginSettingsError(f"{ENV}: artifact {artifact} is not a file")
    return PluginSettings(config, artifact)


def from_env(environ: dict | None = None) -> PluginSettings | None:
    """The plugin's settings, or None when the variable is unset (the plugin stays off)."""
    text = (os.environ if environ is None else environ).get(ENV)
    return None if text is None else parse(text)


def _check(config: InfiniGenConfig) -> None:
    if config.policy not in POLICIES:
        raise PluginSettingsError(
            f"{ENV}: policy {config.policy!r} does not run inside vLLM; use one of {', '.join(POLICIES)} "
            "(vLLM's own backend is the dense reference: leave the variable unset)"
        )
    if config.tier != "ram":
        raise PluginSettingsError(f"{ENV}: tier {config.tier!r} is not served inside vLLM yet; use tier=ram")
    if config.policy == "infinigen":
        if config.speculate_from == "previous":
            raise PluginSettingsError(
                f"{ENV}: speculate_from 'previous' needs layer i's own query projection apart from vLLM's fused "
                "one; use fitted (the default) or own"
            )
        if config.channel_allocation != "uniform":
            raise PluginSettingsError(f"{ENV}: channel_allocation must be uniform: vLLM's page has one size")
        if config.partial_format != PAGE_FORMAT:
            raise PluginSettingsError(f"{ENV}: partial_format must be {PAGE_FORMAT}: vLLM's page holds those codes")
        if config.unit_keys != "positions" or config.unit_heads == "shared":
            raise PluginSettingsError(f"{ENV}: unit_keys must be positions and unit_heads per head inside vLLM")
