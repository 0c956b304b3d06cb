"""What a cache keeps next to the compute, by part, and what dense would keep in its place.

An offloading system is judged first by what stays in the compute's memory: the KV that does not
fit there is the reason it exists. `memory_report(cache)` counts, from the cache's own objects,
every KV-related byte it keeps with the compute (`PARTS`), what its slow tier holds, and what
dense decoding keeps for the same batch and positions (`dense_kv_bytes`), so that the share is a
measured ratio, not a modelled one. Weights are reported apart.

Where the slow tier is host RAM on a CPU-only machine (tier ``ram``: the stand-in for a GPU's
host memory) the tier and the compute share one memory; `tier_kv_bytes` is reported beside
`compute_kv_bytes` for that reason, and never folded into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# What a cache may keep with the compute, in the order reports list them.
PARTS = (
    "speculation_state",  # the selector's memory: partial keys (infinigen), page bounds (quest), scores (h2o)
    "transfer_buffers",  # where fetched rows land, two pairs per cache
    "dense_layers",  # the whole KV of layers kept with the compute (every layer under dense)
    "local_layers",  # sliding-window layers' windows
    "block_cache",  # RAM copies of disk blocks (disk tier)
    "tier_buffers",  # the disk tier's unwritten tails and its aligned staging/read buffers
    "metadata",  # which positions are real, the pool's and block cache's maps
)


@dataclass
class MemoryReport:
    """Bytes, at the moment it was taken. `parts` are with the compute (`PARTS`)."""

    parts: dict[str, int]
    tier_kv_bytes: int  # the offloaded KV in the slow tier's medium (spare capacity included)
    dense_kv_bytes: int  # what dense keeps for the same batch and positions, in the KV's storage dtype
    weight_bytes: int  # the model's parameters, apart
    selector_weight_bytes: int  # what the selector keeps per model (projections, query maps), apart
    batch: int
    positions: int
    tier: str

    @property
    def compute_kv_bytes(self) -> int:
        """Every KV-related byte kept with the compute (weights excluded)."""
        return sum(self.parts.values())

    @property
    def compute_share(self) -> float | None:
        """compute_kv_bytes as a fraction of dense's KV (None before any KV)."""
        return self.compute_kv_bytes / self.dense_kv_bytes if self.dense_kv_bytes else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "compute_kv_bytes": self.compute_kv_bytes,
            "dense_kv_bytes": self.dense_kv_bytes,
            "compute_share_of_dense_kv": self.compute_share,
            "compute_parts": {p: self.parts.get(p, 0) for p in PARTS},
            "tier_kv_bytes": self.tier_kv_bytes,
            "tier": self.tier,
            "weight_bytes": self.weight_bytes,
            "selector_weight_bytes": self.selector_weight_bytes,
            "batch": self.batch,
            "positions": self.positions,
        }

    def line(self) -> str:
        return memory_line(self.to_dict())


def memory_line(memory: dict[str, Any]) -> str:
    """One line for a person from `MemoryReport.to_dict()`: what is kept with the compute, as a
    share of dense's KV, its largest parts, and what the slow tier holds."""
    share = memory["compute_share_of_dense_kv"]
    top = sorted(((b, p) for p, b in memory["compute_parts"].items() if b), reverse=True)[:3]
    parts = ", ".join(f"{p.replace('_', ' ')} {format_bytes(b)}" for b, p in top)
    tier = f"; {format_bytes(memory['tier_kv_bytes'])} in the {memory['tier']} tier" if memory["tier_kv_bytes"] else ""
    return (
        f"kept with the compute: {format_bytes(memory['compute_kv_bytes'])}"
        + ("" if share is None else f" = {100 * share:.1f}% of dense's KV ({format_bytes(memory['dense_kv_bytes'])})")
        + (f" ({parts})" if parts else "")
        + (_why_over_dense(memory) if share is not None and share > 1 and memory.get("tier") != "compute" else "")
        + tier
    )


def _why_over_dense(memory: dict[str, Any]) -> str:
    """Why an offloading cache keeps more than dense's KV: the parts have minimum sizes (growth
    room, rows read per layer, whole disk blocks and the read buffer) that a short context's KV
    does not fill. (Dense itself keeps its KV and the room preallocated for the generation.)"""
    held = memory["compute_parts"]
    floors = [
        what
        for what, parts in (
            ("room to grow", ("speculation_state", "dense_layers", "local_layers")),
            ("transfer buffers", ("transfer_buffers",)),
            ("whole disk blocks and read buffers", ("tier_buffers", "block_cache")),
        )
        if any(held.get(p) for p in parts)
    ]
    context = f"a context of {memory['positions']} positions" if memory.get("positions") else "a context this short"
    return (
        f"; over 100% as these parts have minimum sizes ({', '.join(floors) or 'buffers'}) that {context} does not "
        "fill: the share falls as the context grows"
    )


def format_bytes(n: float) -> str:
    """Bytes for a person, in binary units (what every report of this package prints)."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def kv_row_bytes(adapter, dtype: torch.dtype) -> int:
    """Bytes of one position's K and V over every KV head of one layer, in `dtype`."""
    return 2 * adapter.num_kv_heads * adapter.head_dim * torch.empty((), dtype=dtype).element_size()


def dense_kv_bytes(adapter, batch: int, positions: int, dtype: torch.dtype) -> int:
    """What dense decoding keeps for `batch` sequences of `positions`: every position of every
    global layer, and each sliding-window layer's window (transformers' own rule)."""
    row = kv_row_bytes(adapter, dtype)
    total = 0
    for i in range(adapter.num_layers):
        kept = min(positions, adapter.window(i) - 1) if adapter.is_local(i) else positions
        total += batch * kept * row
    return total


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())


def memory_report(cache) -> MemoryReport:
    """Count what `cache` (an open InfiniGenCache) keeps, by walking its layers, tiers, buffers
    and selector states."""
    from infinigen.layers import ComputeLayer, LocalLayer, OffloadedLayer

    parts = dict.fromkeys(PARTS, 0)
    tier_bytes = 0
    dtype = None
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            dtype = dtype or layer.dtype
        if isinstance(layer, ComputeLayer):
            parts["dense_layers"] += layer.held_bytes()
        elif isinstance(layer, LocalLayer):
            parts["local_layers"] += layer.held_bytes()
        elif isinstance(layer, OffloadedLayer):
            if layer.selecting is not None:
                parts["speculation_state"] += layer.selecting.held_bytes()
            if layer.tier is not None:
                tier_bytes += layer.tier.stored_bytes()
                for part, n in layer.tier.beside_compute().items():
                    parts[part] += n
    parts["transfer_buffers"] += cache.shared_buffers_bytes()
    for part, n in cache.storage.beside_compute().items():
        parts[part] += n
    parts["metadata"] += cache.positions.nbytes
    storage_dtype = cache.config.storage_dtype() or dtype or torch.float32
    batch = max(cache.counters.batch, 0)
    positions = cache.layers[0].get_seq_length() if cache.layers else 0
    return MemoryReport(
        parts=parts,
        tier_kv_bytes=tier_bytes,
        dense_kv_bytes=dense_kv_bytes(cache.adapter, batch, positions, storage_dtype),
        weight_bytes=weight_bytes(cache.adapter.model),
        selector_weight_bytes=cache.selector.weight_bytes() if cache.selector is not None else 0,
        batch=batch,
        positions=positions,
        tier=cache.config.tier if any(isinstance(x, OffloadedLayer) for x in cache.layers) else "compute",
    )
