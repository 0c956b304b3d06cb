"""One validated configuration: every setting is declared once, here or next to its selector.

Every field carries its help text and its rule (`infinigen.validation.knob`); validation happens
at construction, so a bad value fails before any model work starts. The CLI flags of every
command, `eval --set` and the benchmark's settings are derived from these fields
(`infinigen.cli_settings`), never listed by hand.

Each selector declares its own knobs next to its code (`infinigen.select`: `SpeculationKnobs` in
infinigen.py, `H2OKnobs`, `StreamingKnobs`, `QuestKnobs`, and `SelectionBudget`, the budget they
all share, in base.py) together with what its policy means. This module reads the selectors'
registry (`infinigen.select.SELECTORS`): the user-facing `InfiniGenConfig` is the union of every
selector's knobs plus placement and storage, so that users write one flat config
(``InfiniGenConfig(alpha=4, budget=0.1)``) and `config.knobs(H2OKnobs)` hands a selector exactly
its part. The arrow points one way: the config imports the selectors; they never import it.

User settings and research switches: a few settings are what a user chooses (policy, budget,
where the KV lives, threads); the rest are the method's and the baselines' knobs, whose defaults
were measured, marked ``advanced`` (`advanced_settings`) and shown apart on the command line.

`POLICIES` is the one list of policy names: what each means for placement (KV with the
compute, or offloaded to a slow tier), selection (which selector, or every row) and storage
format (native or int4). The policies that read every row are declared here; each selecting
one comes from its selector's file.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, fields
from typing import Any

import torch

from infinigen.roles import Role
from infinigen.select import SELECTORS
from infinigen.select.base import SELECTING_BUDGET as SELECTING_BUDGET  # declared with the selectors; named here too
from infinigen.select.base import UNIT_BUDGET, PolicySpec, UnitSelection
from infinigen.select.infinigen import SpeculationKnobs as SpeculationKnobs  # likewise (calibration reads it)
from infinigen.storage import COPY_ENGINES, EVICTIONS, TIERS, check_combination, read_unit
from infinigen.validation import (
    ConfigError,
    Rule,
    at_least,
    fraction,
    knob,
    one_of,
    parse_size,
    resolve_size,
    size,
    size_or_share,
)

# ---------------------------------------------------------------------- policies
# `compute_memory`'s default: a target, not a limit. An offloading policy keeps at most this share of
# dense's KV with the compute where it can without changing its output; where it cannot, it takes the
# smallest plan that leaves its output unchanged.
AUTO = "auto"
AUTO_SHARE = "12.5%"
_SIZE_OR_SHARE = size_or_share()
METHOD = "infinigen"  # the default policy: the method this package implements
# The policies without a selector: every row, every step, with the compute or from the slow tier.
READING_EVERY_ROW: dict[str, PolicySpec] = {
    "dense": PolicySpec("compute", None, summary="the whole KV stays with the compute (quality reference)"),
    "full": PolicySpec("offload", None, summary="every row from the slow tier each step (full-fetch offload)"),
    "int4": PolicySpec("offload", None, "int4", summary="every row, stored group-wise 4-bit (FlexGen)"),
}
# Every policy: the method first, then the references that read every row, then the selecting
# baselines in the registry's order.
POLICIES: dict[str, PolicySpec] = {
    METHOD: SELECTORS[METHOD].policy,
    **READING_EVERY_ROW,
    **{name: cls.policy for name, cls in SELECTORS.items() if name != METHOD},
}
KV_DTYPES = (None, "float32", "float16", "bfloat16")


def _selector_knobs() -> tuple[type, ...]:
    """Every selector's knob dataclass, once each, in the registry's order: the bases of
    `InfiniGenConfig`. A knob two selectors declare apart would be one flat setting with two
    meanings: refused here, when the package is imported."""
    classes = tuple(dict.fromkeys(cls.Knobs for cls in SELECTORS.values()))
    shared = {f.name for f in fields(UnitSelection)}  # SelectionBudget's and the units'
    owner: dict[str, str] = {}
    for cls in classes:
        for f in fields(cls):
            if f.name not in shared and owner.setdefault(f.name, cls.__name__) != cls.__name__:
                raise TypeError(f"setting {f.name!r} is declared by both {owner[f.name]} and {cls.__name__}")
    return classes


SELECTOR_KNOBS = _selector_knobs()


@dataclass(frozen=True)
class InfiniGenConfig(*SELECTOR_KNOBS):
    """Every setting of InfiniGen and of the baselines measured in the same harness.

    The selectors' knobs are inherited from their dataclasses (`SELECTOR_KNOBS`, from the
    registry); placement and storage follow.
    """

    policy: str = knob(METHOD, f"what decides the rows each step reads: {', '.join(POLICIES)}", one_of(tuple(POLICIES)))
    dense_layers: int = knob(2, "first layers that are not speculated and read every row", at_least(1), advanced=True)
    dense_layers_on_compute: bool = knob(
        True,
        "keep the dense layers' KV with the compute instead of re-reading it from the slow tier",
        advanced=True,
    )
    windows_on_compute: bool = knob(
        True,
        "keep the sliding-window layers' windows with the compute instead of reading each step's window back "
        "from the slow tier (which then holds every position of those layers; exact, only speed)",
        advanced=True,
    )
    fetch_chunk: int = knob(
        0,
        "layers that read every row (full fetch; the dense layers when not kept with the compute) read and "
        "attend it this many positions at a time, the next chunk read while one is attended (an online "
        "softmax, exact): their transfer buffers hold two chunks instead of a whole layer (0: the whole layer "
        "at once, issued one layer ahead)",
        at_least(0),
        advanced=True,
    )
    kv_dtype: str | None = knob(
        None, "storage dtype of the KV: float32, float16 or bfloat16 (default: as computed)", one_of(KV_DTYPES)
    )
    tier: str = knob(
        "ram", "slow tier holding the offloaded KV: ram, disk (O_DIRECT file) or pinned (CUDA)", one_of(TIERS)
    )
    kv_dir: str | None = knob(
        None,
        "an existing folder for the disk tier's files (default $INFINIGEN_KV_DIR or the temp folder)",
        Rule("a folder path (not empty)", lambda v: bool(v.strip())),
    )
    io_threads: int = knob(4, "disk reads in flight", at_least(1))
    read_chunk: str = knob(
        "8MiB",
        "disk tier: the most bytes one round of a gather, or one piece of a range read (a layer's rows, a "
        "window), reads at once; its read buffer holds up to about twice this (smaller keeps less with the "
        "compute; larger keeps more reads in flight)",
        size(),
        advanced=True,
    )
    block_cache: float = knob(
        0.0,
        "disk tier: fraction of each layer's 4 KiB blocks also kept in RAM as a read cache (lossless; when full, "
        "CLOCK picks the copy to drop: one read since the clock hand last passed it is spared once); 0 reads "
        "every block from disk",
        fraction(low_open=False),
    )
    copy_engine: str = knob(
        "auto",
        "pinned tier: how rows reach the compute device: auto (CUDA side streams on a GPU), cuda, or threads "
        "(the same protocol on CPU threads, to run it without a GPU)",
        one_of(COPY_ENGINES),
        advanced=True,
    )
    host_capacity: float | None = knob(
        None,
        "cap the speculated layers' rows to this fraction of the generation's positions in a host pool "
        "(lossy when below 1); default: no pool",
        fraction(),
    )
    eviction: str = knob("counter", "host pool victim: counter (least fetched), lru or fifo", one_of(EVICTIONS))
    compute_memory: str | None = knob(
        AUTO,
        "the most KV-related bytes kept next to the compute: a size (e.g. 512MiB) or a share of what dense "
        "keeps for the same batch and positions (e.g. 12.5%); the cache gives up block cache, then shrinks the "
        "disk's rounds of reads, then reads the dense layers from the tier in chunks, then the sliding "
        "windows, then lowers partial-key precision, to fit, and refuses a request that cannot. auto (the default): an "
        f"offloading policy aims at {AUTO_SHARE} of dense's KV with the steps that leave its output unchanged, "
        "and takes the smallest of them where that share cannot be met (reported, not refused); none: no budget",
        Rule(f"auto, or {_SIZE_OR_SHARE.text}", lambda v: v == AUTO or _SIZE_OR_SHARE.ok(v)),
    )
    measure_recall: bool = knob(
        False, "also compute dense attention to report recall (evaluation only; slow)", advanced=True
    )
    compute_threads: int | None = knob(
        None,
        "torch intra-op threads while attached (default: for offloading policies one less than torch's current "
        "count, which leaves a core to the prefetch and I/O threads; unchanged for dense)",
        Rule("an integer in [1, 1024]", lambda v: 1 <= v <= 1024),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        spec = POLICIES[self.policy]
        if self.host_capacity is not None and spec.selector is None:
            raise ConfigError(f"host_capacity needs a selecting policy (policy {self.policy!r} reads every row)")
        if not self.windows_on_compute and spec.fmt != "native":
            raise ConfigError(
                f"windows_on_compute=False reads the sliding windows back exactly, which policy {self.policy!r} "
                f"cannot: it stores {spec.fmt} codes"
            )
        if spec.placement == "offload":  # storage owns which tiers hold what
            try:
                check_combination(self.tier, spec.fmt, pooled=self.host_capacity is not None)
            except ValueError as exc:
                raise ConfigError(f"policy {self.policy!r}: {exc}") from None

    def check_layers(self, num_layers: int) -> None:
        """Refuse settings that name layers a model of `num_layers` layers does not have (they
        would be ignored without a word)."""
        wrong = sorted(i for i in self.layer_alpha if not 0 <= i < num_layers)
        if wrong:
            raise ConfigError(
                f"layer_alpha names layer {wrong[0]}, but the model has {num_layers} layers (0 to {num_layers - 1})"
            )

    # ------------------------------------------------------------------ derived decisions
    @property
    def spec(self) -> PolicySpec:
        return POLICIES[self.policy]

    @property
    def watches_prefill(self) -> bool:
        """Whether the policy's selector reads the prefill's attention (H2O): a replayed prefix
        must then carry the prompt's attention column sums."""
        from infinigen.select.base import watches_prefill

        name = self.spec.selector
        return name is not None and watches_prefill(SELECTORS[name])

    @property
    def aims(self) -> bool:
        """Whether `compute_memory` is the default aim (`AUTO`) rather than a limit."""
        return self.compute_memory == AUTO

    def compute_memory_bytes(self, dense_kv_bytes: int) -> int | None:
        """`compute_memory` in bytes (None: no budget), a share taken of `dense_kv_bytes` (what
        dense keeps for the request, in the KV's storage dtype). The aim applies to offloading
        policies only: one that keeps the KV with the compute has nothing to plan."""
        if self.compute_memory is None or (self.aims and self.spec.placement != "offload"):
            return None
        return resolve_size(AUTO_SHARE if self.aims else self.compute_memory, dense_kv_bytes)

    @property
    def read_chunk_bytes(self) -> int:
        return parse_size(self.read_chunk)

    @property
    def resolved_budget(self) -> float:
        return self.budget if self.budget is not None else self.spec.default_budget

    def layer_role(self, layer: int, local: bool = False) -> Role:
        """``compute``: the layer's whole KV stays with the compute; ``fetch_all``: it is offloaded
        and every row is read each step; ``select``: offloaded, the selector's rows are read;
        ``local``: a sliding-window layer (`local`, as the model's adapter says), whose KV is
        bounded by its window and stays with the compute; ``window``: such a layer of an
        offloading policy with `windows_on_compute` off, its KV in the tier and its window read
        back each step. Sliding layers are never speculated. `dense_layers` counts layers by
        index, local ones included."""
        spec = self.spec
        if local:
            return Role.WINDOW if spec.placement == "offload" and not self.windows_on_compute else Role.LOCAL
        if spec.placement == "compute":
            return Role.COMPUTE
        if spec.selector is None:
            return Role.FETCH_ALL
        if layer >= self.dense_layers:
            return Role.SELECT
        return Role.COMPUTE if self.dense_layers_on_compute else Role.FETCH_ALL

    def layer_roles(self, adapter) -> list[Role]:
        """Every layer's role for a model (`adapter`: its layer count and which layers slide):
        the one list the cache, the planner, the selectors and the evaluator act on."""
        return [self.layer_role(i, local=adapter.is_local(i)) for i in range(adapter.num_layers)]

    def in_read_units(self, head_dim: int, compute_dtype: torch.dtype) -> InfiniGenConfig:
        """This config with the unit its selector chooses in made concrete: `block_tokens` left
        unset becomes the tier's read unit (`storage.read_unit`: a disk block's positions of one
        KV head, one row elsewhere), so that every row read is attended. In units of several
        positions an unset budget is `UNIT_BUDGET` (a unit reads no row it does not attend, so a
        larger share of the context costs fewer bytes than `SELECTING_BUDGET` row by row from a
        block tier) and an unset correction is 0 (its calibrated top-up is row by row). The one
        place these defaults are decided; a session's caches and selectors are made from its
        result (head_dim: the model's; compute_dtype: what the KV is computed in)."""
        name = self.spec.selector
        if name is None or not issubclass(SELECTORS[name].Knobs, UnitSelection):
            return self
        dtype = self.storage_dtype() or compute_dtype
        unit = self.block_tokens or read_unit(self.tier, self.spec.fmt, head_dim, dtype, self.kv_dir)
        changes: dict[str, Any] = {"block_tokens": unit}
        if unit > 1 and self.budget is None:
            changes["budget"] = UNIT_BUDGET
        if unit > 1 and self.correction is None:
            changes["correction"] = 0.0
        return self.replace(**changes)

    def threads(self, current: int) -> int:
        """Intra-op threads for this config, given torch's `current` count: an offloading policy
        runs a prefetch thread (selection, gathers) beside the compute, which must not wait
        for a core: compute threads on every core leave the prefetch waiting, and the whole step with it."""
        if self.compute_threads is not None:
            return self.compute_threads
        return max(1, current - 1) if self.spec.placement == "offload" else current

    def storage_dtype(self) -> torch.dtype | None:
        """The dtype the offloaded KV is stored in (None: the dtype it is computed in)."""
        return None if self.kv_dtype is None else getattr(torch, self.kv_dtype)

    def skew_key(self) -> tuple[float, bool, int | None]:
        """What the skew artifact depends on: a session reuses one artifact for configs that share it."""
        return (round(self.partial_ratio, 6), self.skew, self.calibration_tokens)

    def knobs(self, cls: type) -> Any:
        """This config's part that `cls` (a knob dataclass) declares, budget resolved."""
        values = {f.name: getattr(self, f.name) for f in fields(cls)}
        if "budget" in values:
            values["budget"] = self.resolved_budget
        return cls(**values)

    def speed_reference(self) -> InfiniGenConfig:
        """Dense with its KV kept as computed, preallocated: the fastest dense, which the demo and
        `bench decode` compare speed with. (Dense stored in 16 bits keeps half the bytes but widens
        its whole past every step, which costs more time than the smaller reads save.)"""
        return self.replace(policy="dense", kv_dtype=None, host_capacity=None)

    def replace(self, **changes: Any) -> InfiniGenConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: infinite alphas as "inf", layer keys as strings (`from_dict` reverses it)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["alpha"] = "inf" if math.isinf(self.alpha) else self.alpha
        out["layer_alpha"] = {str(k): ("inf" if math.isinf(v) else v) for k, v in self.layer_alpha.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InfiniGenConfig:
        data = dict(data)
        if "alpha" in data:
            data["alpha"] = float(data["alpha"])
        if "layer_alpha" in data:
            data["layer_alpha"] = {int(k): float(v) for k, v in data["layer_alpha"].items()}
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown settings {sorted(unknown)}; known: {', '.join(f.name for f in fields(cls))}")
        return cls(**data)


# ---------------------------------------------------------------------- the settings, described
def setting_fields() -> dict[str, dataclasses.Field]:
    """Every setting, by name, in declaration order (what the CLI derives its flags from)."""
    return {f.name: f for f in fields(InfiniGenConfig)}


def setting_type(name: str) -> Any:
    """The annotated type of setting `name`."""
    return typing.get_type_hints(InfiniGenConfig)[name]


def setting_default(name: str) -> Any:
    """The library's default of setting `name` (a command may state its own)."""
    f = setting_fields()[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def advanced_settings() -> tuple[str, ...]:
    """The research switches: the method's and the baselines' knobs, whose defaults were
    measured; a user changes them to study the method, not to run it."""
    return tuple(name for name, f in setting_fields().items() if f.metadata["advanced"])
