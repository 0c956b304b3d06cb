"""`dense`: the whole KV cache stays with the compute — the quality reference, no fetch."""

from __future__ import annotations

from infinigen.policies.base import Policy


class DensePolicy(Policy):
    name = "dense"
    keeps_kv_on_compute = True

    def store(self, x, kv_dtype):
        return x  # never leaves the compute, never rounded
