"""`int4`: full fetch of a group-wise 4-bit asymmetric KV (group 64 along the head dimension,
min/max per group), the KV compression of FlexGen (Sheng et al., ICML 2023). Every row moves,
at 72 instead of 256 bytes per position and KV head for d = 64."""

from __future__ import annotations

import torch

from infinigen.config import ConfigError
from infinigen.kv.quantized import Int4RamTier, fake_quantize_int4, int4_row_bytes
from infinigen.policies.base import Policy

GROUP = 64


class Int4Policy(Policy):
    name = "int4"

    def __init__(self, config, adapter, attachment=None) -> None:
        super().__init__(config, adapter, attachment)
        if config.tier != "ram":
            raise ConfigError("policy int4 keeps its packed KV in host RAM: use tier='ram'")

    def store(self, x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
        # The tier quantizes the value in its storage dtype and dequantizes straight to fp32.
        return fake_quantize_int4(x.to(kv_dtype).to(torch.float32), GROUP).to(x.dtype)

    def row_bytes(self, head_dim: int, kv_dtype: torch.dtype) -> int:
        return int4_row_bytes(head_dim, GROUP)

    def make_tier(self, batch, kv_heads, head_dim, kv_dtype, stats, default):
        return Int4RamTier(batch, kv_heads, head_dim, kv_dtype, stats, group=GROUP)
