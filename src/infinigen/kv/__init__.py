"""Slow KV tiers and the counters of every byte moved out of them."""

from infinigen.kv.stats import TransferStats
from infinigen.kv.tiers import KVTier, RamTier, make_tier

__all__ = ["KVTier", "RamTier", "TransferStats", "make_tier"]
