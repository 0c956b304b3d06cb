"""InfiniGenConfig: every knob of the method in one validated place.

Validation happens at construction so that a bad value fails before any model work starts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

POLICIES = ("infinigen", "full", "dense", "h2o", "streaming", "int4", "quest", "oracle")
BUDGETED = ("h2o", "streaming", "quest", "oracle")
AGGREGATIONS = ("max", "sum", "union", "mass")
KV_DTYPES = (None, "float32", "float16", "bfloat16")
TIERS = ("ram", "disk", "pinned")
EVICTIONS = ("counter", "lru", "fifo")


class ConfigError(ValueError):
    """An invalid configuration value (raised before any work starts)."""


@dataclass
class InfiniGenConfig:
    """Settings of InfiniGen and of the two reference policies.

    policy:        ``infinigen`` (speculate and fetch the selection), ``full`` (fetch every row
                   from the slow tier each step: the full-fetch offload baseline), ``dense``
                   (keep the whole KV cache with the compute: the upper bound), or a baseline
                   measured in the same harness: ``h2o``, ``streaming``, ``int4``, ``quest``,
                   ``oracle`` (see ``infinigen.policies``).
    alpha:         threshold in logit units: keep positions with ``s >= max(s) - alpha``;
                   ``math.inf`` keeps everything.
    partial_ratio: fraction r of the head dimension kept as partial channels.
    budget:        cap on the selected positions as a fraction of the context, in (0, 1]; for
                   h2o, streaming, quest and oracle it is the number they keep.
    budget_tokens: optional absolute cap (positions per KV head); the smaller cap wins.
    min_tokens:    floor on the selected positions per KV head (never more than the context).
    dense_layers:  layers ``< dense_layers`` are not speculated and fetch everything.
    aggregation:   how a GQA group's query-head scores become one selection per KV head:
                   ``union`` (default), ``max``, ``sum`` or ``mass`` (the group's summed
                   estimated attention probability, the oracle's ranking; see speculate.py).
    skew:          use the SVD skew (``False``: identity, i.e. plain channel choice).
    kv_dtype:      storage dtype of the slow tier (``None``: the model's dtype).
    calibration_tokens: length of the calibration sequence (``None``: the model's context,
                   capped at 8192) — the skew of RoPE models depends on position, so it must be
                   calibrated over the positions that will be decoded.
    measure_recall: also compute dense attention (outside the byte counters) to report the
                   attention-mass recall of every selection; slow, for evaluation only.
    tier:          the slow tier holding the full KV: ``ram`` (host memory) or ``disk`` (a file
                   read with O_DIRECT under ``kv_dir``, default ``$INFINIGEN_KV_DIR`` or the
                   system temporary folder).
    io_threads:    reads in flight per disk tier.
    host_capacity: fraction of the context each (batch, KV head) keeps in the host pool
                   (``ram`` tier); 1.0 keeps everything. Below 1.0, eviction is lossy.
    eviction:      victim policy when the host pool is full: ``counter`` (least often fetched),
                   ``lru`` or ``fifo``.
    dense_layers_on_compute: keep the KV of the ``dense_layers`` first layers with the compute
                   (2 of 30 layers: 7% of the cache for SmolLM2) instead of re-reading all of it
                   from the slow tier at every step; ``False`` streams them like the rest.
    layer_alpha:   per-layer overrides of alpha, {layer: alpha}.
    sinks:         streaming: attention-sink positions kept at the start.
    recent_ratio:  h2o: share of the budget kept as the most recent positions.
    page_tokens:   quest: positions per page.
    block_tokens:  selection granularity: 1 selects positions (the published method); B > 1
                   selects aligned blocks of B positions scored by their best position, which
                   matches what a block device reads anyway (16 for the disk tier at d = 64, fp16).
    """

    policy: str = "infinigen"
    alpha: float = 5.0
    partial_ratio: float = 0.3
    budget: float = 1.0
    budget_tokens: int | None = None
    min_tokens: int = 8
    dense_layers: int = 2
    aggregation: str = "union"
    skew: bool = True
    kv_dtype: str | None = None
    calibration_tokens: int | None = None
    measure_recall: bool = False
    tier: str = "ram"
    kv_dir: str | None = None
    io_threads: int = 4
    host_capacity: float = 1.0
    eviction: str = "counter"
    dense_layers_on_compute: bool = True
    block_tokens: int = 1
    layer_alpha: dict[int, float] = field(default_factory=dict)
    sinks: int = 4
    recent_ratio: float = 0.5
    page_tokens: int = 16
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.alpha, (int, float)) or math.isnan(self.alpha) or self.alpha < 0:
            raise ConfigError(f"alpha must be a number >= 0 (math.inf keeps everything), got {self.alpha!r}")
        if not isinstance(self.partial_ratio, (int, float)) or not 0 < self.partial_ratio <= 1:
            raise ConfigError(f"partial_ratio must be in (0, 1], got {self.partial_ratio!r}")
        if not isinstance(self.budget, (int, float)) or not 0 < self.budget <= 1:
            raise ConfigError(f"budget must be a fraction of the context in (0, 1], got {self.budget!r}")
        if self.budget_tokens is not None and (not isinstance(self.budget_tokens, int) or self.budget_tokens < 1):
            raise ConfigError(f"budget_tokens must be a positive integer or None, got {self.budget_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise ConfigError(f"min_tokens must be an integer >= 1, got {self.min_tokens!r}")
        if not isinstance(self.dense_layers, int) or self.dense_layers < 1:
            # Layer 0 has no previous layer to speculate from, so at least one layer is dense.
            raise ConfigError(f"dense_layers must be an integer >= 1, got {self.dense_layers!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.calibration_tokens is not None and (
            not isinstance(self.calibration_tokens, int) or self.calibration_tokens < 16
        ):
            raise ConfigError(f"calibration_tokens must be an integer >= 16 or None, got {self.calibration_tokens!r}")

        if not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise ConfigError(f"block_tokens must be an integer >= 1, got {self.block_tokens!r}")
        if not isinstance(self.layer_alpha, dict) or any(
            not isinstance(k, int) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0
            for k, v in self.layer_alpha.items()
        ):
            raise ConfigError(f"layer_alpha must map layer indices to numbers >= 0, got {self.layer_alpha!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ConfigError(f"sinks must be an integer >= 0, got {self.sinks!r}")
        if not isinstance(self.recent_ratio, (int, float)) or not 0 <= self.recent_ratio <= 1:
            raise ConfigError(f"recent_ratio must be in [0, 1], got {self.recent_ratio!r}")
        if not isinstance(self.page_tokens, int) or self.page_tokens < 1:
            raise ConfigError(f"page_tokens must be an integer >= 1, got {self.page_tokens!r}")
        if self.tier not in TIERS:
            raise ConfigError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ConfigError(f"io_threads must be an integer >= 1, got {self.io_threads!r}")
        if not isinstance(self.host_capacity, (int, float)) or not 0 < self.host_capacity <= 1:
            raise ConfigError(f"host_capacity must be a fraction in (0, 1], got {self.host_capacity!r}")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")
        if self.policy == "int4" and self.tier != "ram":
            raise ConfigError("policy int4 keeps its packed KV in host RAM: use tier='ram'")
        if self.host_capacity < 1 and self.tier != "ram":
            raise ConfigError("host_capacity < 1 applies to the host pool: use tier='ram'")
        if self.host_capacity < 1 and self.policy != "infinigen":
            raise ConfigError("host_capacity < 1 needs policy='infinigen' (the pool evicts by fetch statistics)")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if math.isinf(out["alpha"]):
            out["alpha"] = "inf"
        out["layer_alpha"] = {str(k): ("inf" if math.isinf(v) else v) for k, v in self.layer_alpha.items()}
        return out
