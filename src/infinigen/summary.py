"""What a cache reports after a generation: what it moved, selected and waited for, in total and
per layer, with what it kept next to the compute (`InfiniGenCache.summary()`)."""

from __future__ import annotations

from typing import Any

from infinigen.layers import LocalLayer, OffloadedLayer
from infinigen.roles import Role


def summarize(cache) -> dict[str, Any]:
    """What `cache` moved and selected (decode steps only)."""
    c, stats = cache.counters, cache.storage.stats
    per_layer = [_layer_summary(cache, i, layer) for i, layer in enumerate(cache.layers)]
    selected = [p for p in per_layer if p["speculated"]]
    fractions = [p["fetched_fraction"] for p in selected if p["fetched_fraction"] is not None]
    recalls = [p["recall"] for p in selected if p["recall"] is not None]
    if not any(isinstance(layer, OffloadedLayer) for layer in cache.layers):
        fetched = None  # nothing is offloaded, nothing is fetched
    elif not selected:
        fetched = 1.0
    else:
        fetched = sum(fractions) / len(fractions) if fractions else None
    tokens = max(c.decode_steps, 1) * max(c.batch, 1)
    pools = [layer.pool_counts() for layer in cache.layers if isinstance(layer, OffloadedLayer)]
    memory = cache.memory().to_dict()
    return {
        "policy": cache.config.policy,
        "policy_settings": cache.selector.describe() if cache.selector is not None else {"policy": cache.config.policy},
        "decode_steps": c.decode_steps,
        "prefill_tokens": c.prefill_tokens,
        "batch": c.batch,
        "fetched_fraction": fetched,
        "recall": sum(recalls) / len(recalls) if recalls else None,
        "bytes_fetched": stats.bytes,
        "bytes_cached": stats.cached_bytes,
        "rows_fetched": stats.rows,
        "bytes_fetched_per_token": stats.bytes / tokens if c.decode_steps else 0.0,
        "speculation_seconds": c.speculation_seconds,
        "correction_bytes": c.correction_bytes,
        "correction_seconds": c.correction_seconds,
        "wait_seconds": c.wait_seconds,
        "tier": cache.config.tier,
        "evictions": sum(evicted for evicted, _ in pools),
        "host_capacity": cache.config.host_capacity,
        "host_pool_slots": sum(slots for _, slots in pools),
        "read_amplification": stats.amplification,
        "local_kv_bytes": sum(layer.peak_bytes for layer in cache.layers if isinstance(layer, LocalLayer)),
        "selector_bytes": memory["compute_parts"]["speculation_state"],
        "compute_kv_bytes": memory["compute_kv_bytes"],
        "dense_kv_bytes": memory["dense_kv_bytes"],
        "memory": memory,
        "plan": None if cache.plan is None else cache.plan.describe(),
        "per_layer": per_layer,
    }


def _layer_summary(cache, i: int, layer) -> dict[str, Any]:
    """One layer's entry of `summary()`: its role, what it fetched and waited, what the
    selector allowed it, and what the observer measured there."""
    select = layer.role == Role.SELECT
    entry = {
        "layer": i,
        "role": layer.role.value,
        "speculated": select,
        "fetched_fraction": layer.stats.fraction(),
        "recall": None,
        "wait_seconds": layer.stats.wait_seconds,
        "correction_rows": layer.stats.correction_rows,
        "budget": cache.selector.budget(i) if select else None,
        "correction": cache.selector.correction(i) if select else None,
    }
    if cache.observer is not None:
        entry.update(cache.observer.report(i))
    return entry
