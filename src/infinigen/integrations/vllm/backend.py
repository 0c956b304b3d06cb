"""InfiniGen as vLLM's CPU attention backend (`register_backend(AttentionBackendEnum.CPU_ATTN,
...)`): the page it declares holds only the partial keys (`runtime.page_bytes`), so at the same
KV memory vLLM fits more blocks; each layer's forward writes the new tokens' K/V to the slow tier
and their partial keys to the page, and attends what the runtime selects."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from infinigen.integrations.vllm import details, plugin
from infinigen.integrations.vllm.runtime import StepRequests, page_bytes, placeholder_bytes
from infinigen.speculate import channel_count


@dataclass
class InfiniGenMetadata:
    num_actual_tokens: int
    step: StepRequests


class InfiniGenMetadataBuilder(AttentionMetadataBuilder[InfiniGenMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> InfiniGenMetadata:
        m = common_attn_metadata
        r, n = m.num_reqs, m.num_actual_tokens
        step = StepRequests(
            query_start=m.query_start_loc_cpu[: r + 1].tolist(),
            seq_lens=m.seq_lens[:r].cpu().tolist(),
            block_table=m.block_table_tensor[:r],
            slots=m.slot_mapping[:n],
        )
        return InfiniGenMetadata(n, step)


class InfiniGenBackend(CPUAttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @classmethod
    def customize_spec(cls, spec):
        s = plugin.settings()
        itemsize = spec.dtype.itemsize  # vLLM views the page in the model's dtype
        if s.keeps_partial_keys:
            size = page_bytes(channel_count(s.config.partial_ratio, spec.head_size), itemsize)
        else:
            size = placeholder_bytes(itemsize)
        return replace(spec, state_content_bytes=size)

    @staticmethod
    def get_impl_cls():
        return InfiniGenImpl

    @staticmethod
    def get_builder_cls():
        return InfiniGenMetadataBuilder


class InfiniGenImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap=None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        sinks=None,
    ) -> None:
        refused = {
            "ALiBi": alibi_slopes is not None,
            "a sliding window": sliding_window is not None,
            "soft-capped logits": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "shared KV layers": kv_sharing_target_layer_name is not None,
            f"{attn_type} attention": attn_type != AttentionType.DECODER,
            f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype != "auto",
        }
        for what, present in refused.items():
            if present:
                raise details.UnsupportedVllmError(f"infinigen's vLLM plugin does not serve models with {what}")
        self.vllm_config = get_current_vllm_config()
        details.check_engine(self.vllm_config)
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, float(scale), num_kv_heads
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self._layer: int | None = None

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: InfiniGenMetadata | None,
        output: torch.Tensor,
        output_scale=None,
        output_block_scale=None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("infinigen's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's warm-up
            return output
        if self._layer is None:
            self._layer = details.layer_index(layer.layer_name)
        rt = plugin.runtime(self.vllm_config, kv_cache, self.scale)
        n = attn_metadata.num_actual_tokens
        page = kv_cache.view(torch.uint8)
        rt.forward(self._layer, query[:n], key[:n], value[:n], page, attn_metadata.step, output[:n])
        return output
