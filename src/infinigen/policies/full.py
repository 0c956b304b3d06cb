"""`full`: every row of every layer is fetched from the slow tier each step — full-fetch
offloading (the Hugging Face offloaded cache, FlexGen without compression)."""

from __future__ import annotations

from infinigen.policies.base import Policy


class FullPolicy(Policy):
    name = "full"
