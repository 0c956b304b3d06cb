"""What a cache does with one layer's KV: the five roles the config assigns (`layer_role`) and the
cache, the forced evaluator and `summary()` act on.

A `StrEnum`, so a role still equals (and prints, and serializes as) its name: ``Role.SELECT ==
"select"``; code spells the members, reports keep the plain names.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """COMPUTE: the whole KV stays with the compute. FETCH_ALL: offloaded, every row read back each
    step. SELECT: offloaded, the selector's rows read back. LOCAL: a sliding-window layer whose
    window stays with the compute under every policy."""

    COMPUTE = "compute"
    FETCH_ALL = "fetch_all"
    SELECT = "select"
    LOCAL = "local"
    WINDOW = "window"

    @property
    def offloaded(self) -> bool:
        """Whether the layer's KV lives in the slow tier."""
        return self in (Role.FETCH_ALL, Role.SELECT, Role.WINDOW)

    @property
    def sliding(self) -> bool:
        """Whether the layer attends a sliding window (kept or read back)."""
        return self in (Role.LOCAL, Role.WINDOW)
