"""InfiniGen as vLLM's CPU attention backend (`register_backend(AttentionBackendEnum.CPU_ATTN,
...)`): the page it declares holds only the partial keys (`runtime.page_bytes`), so at the same
KV memory vLLM fits more blocks; each layer's forward writes the new tokens' K/V to the slow tier
and their partial keys to the page, and attends what the runtime selects. Prompts are attended by
vLLM's own attention kernel (`VllmPrompts`), so a prefill costs what vLLM's own does."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

from infinigen.integrations.vllm import details, plugin
from infinigen.integrations.vllm.runtime import StepRequests, page_bytes, placeholder_bytes
from infinigen.speculate import channel_count


@dataclass
class InfiniGenMetadata:
    num_actual_tokens: int
    step: StepRequests


@dataclass
class PromptStaging:
    """A step's prompts as vLLM's own kernel attends them in the speculated layers: their token rows,
    and a staging copy of each prompt's context and new rows in vLLM's block layout (`VllmEngine`)."""

    tokens: torch.Tensor | slice  # the prompts' rows of the step
    contexts: list[int]  # per prompt, the positions stored by earlier chunks
    requests: list[int]
    query_start: torch.Tensor  # int32 [P + 1]
    seq_lens: torch.Tensor  # int32 [P]
    table: torch.Tensor  # int32 [P, blocks] staging block ids
    context_slots: torch.Tensor  # int64: staging slots of the stored contexts' positions
    new_slots: torch.Tensor  # int64: staging slots of the new rows
    blocks: int
    scheduler: torch.Tensor


@dataclass
class EngineStep:
    """What vLLM's own kernel needs for a step: every request (the layers that read every row, kept
    in vLLM's own layout in the tier) and the prompts alone (the speculated layers, staged)."""

    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    scheduler: torch.Tensor
    prompts: PromptStaging | None


class VllmEngine:
    """vLLM's own CPU attention kernel where the plugin attends every row:
    - the layers that read every row (the first, dense ones; every layer under full fetch) keep
      their K/V in the tier in vLLM's own block layout (which depends on the CPU's instruction set),
      written by vLLM's own writer and attended in place by its kernel, prompts and decodes alike;
    - the speculated layers keep the tier's row layout, which the plugin's kernels read by
      position; their prompts are copied, with the stored context of a later chunk, into a staging
      cache in vLLM's layout first (a copy of the prompt's K/V per layer, small beside its attention)."""

    def __init__(self, vllm_config, kv_cache_spec, num_heads: int) -> None:
        self.dtype = vllm_config.model_config.dtype
        self.block_size = kv_cache_spec.block_size
        self.kv_heads, self.head_dim, self.num_heads = kv_cache_spec.num_kv_heads, kv_cache_spec.head_size, num_heads
        self.isa = _get_attn_isa(self.dtype, self.block_size, self.head_dim, "auto")
        self._staging: torch.Tensor | None = None

    def _scheduler(self, query_start: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=self.num_heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
            seq_lens=seq_lens, dtype=self.dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1,
            isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,  # as vLLM's own backend: the same sums
        )  # fmt: skip

    def prepare(self, step: StepRequests, query_start: torch.Tensor, seq_lens: torch.Tensor) -> EngineStep:
        """Once a step: the kernel's metadata for every request and for the prompts alone."""
        n = len(step.slots)
        return EngineStep(query_start, seq_lens, step.block_table, step.slots[:n], self._scheduler(query_start, seq_lens),
                          self._prompts(step))  # fmt: skip

    def _prompts(self, step: StepRequests) -> PromptStaging | None:
        prompts = step.prompts()
        if not prompts:
            return None
        bs = self.block_size
        starts, lens, tables, ctx_slots, new_slots, tokens, contexts = [0], [], [], [], [], [], []
        block = 0
        longest = max(-(-step.seq_lens[r] // bs) for r in prompts)
        for r in prompts:
            a, b = step.rows(r)
            n, total = b - a, step.seq_lens[r]
            context = total - n
            nb = -(-total // bs)
            tables.append(list(range(block, block + nb)) + [0] * (longest - nb))
            ctx_slots.append(torch.arange(context) + block * bs)
            new_slots.append(torch.arange(context, total) + block * bs)
            tokens.append(torch.arange(a, b))
            starts.append(starts[-1] + n)
            lens.append(total)
            contexts.append(context)
            block += nb
        tokens_t = torch.cat(tokens)
        first, last = int(tokens_t[0]), int(tokens_t[-1])
        rows: torch.Tensor | slice = tokens_t if last - first + 1 != len(tokens_t) else slice(first, last + 1)
        qsl = torch.tensor(starts, dtype=torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32)
        return PromptStaging(rows, contexts, prompts, qsl, seq, torch.tensor(tables, dtype=torch.int32),
                             torch.cat(ctx_slots).to(torch.int64), torch.cat(new_slots).to(torch.int64), block,
                             self._scheduler(qsl, seq))  # fmt: skip

    @staticmethod
    def _caches(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's key and value caches: views of [blocks, Hkv, 2 * block_size, d], as its backend makes them."""
        return kv.chunk(2, dim=2)

    def every_row(self, rt, layer: int, query, key, value, step: StepRequests, output) -> None:
        """A layer that reads every row: its tier in vLLM's layout, written and attended by vLLM's kernel."""
        meta: EngineStep = step.engine
        key_cache, value_cache = self._caches(rt.store.layer(layer))
        n = len(meta.slots)
        ops.cpu_attn_reshape_and_cache(key[:n], value[:n], key_cache, value_cache, meta.slots, self.isa)
        ops.cpu_attention_with_kv_cache(
            query=query[:n], key_cache=key_cache, value_cache=value_cache, output=output[:n],
            query_start_loc=meta.query_start, seq_lens=meta.seq_lens, scale=rt.adapter.scaling(layer), causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=meta.block_table, softcap=0.0,
            scheduler_metadata=meta.scheduler, s_aux=None,
        )  # fmt: skip

    def prompts(self, rt, layer: int, prompts, query, key, value, step: StepRequests, output) -> None:
        """A speculated layer's prompts, attended by vLLM's kernel over a staging copy."""
        meta: PromptStaging = step.engine.prompts
        if self._staging is None or self._staging.shape[0] < meta.blocks:  # kept, grown when a step needs more
            blocks = meta.blocks + meta.blocks // 4
            self._staging = torch.empty((blocks, self.kv_heads, 2 * self.block_size, self.head_dim), dtype=self.dtype)
        key_cache, value_cache = self._caches(self._staging[: meta.blocks])
        if any(meta.contexts):  # later chunks: their stored context, copied from the tier
            read = rt.store.bytes_read
            ks, vs = [], []
            for r, context in zip(meta.requests, meta.contexts):
                if context:
                    positions = torch.arange(context).expand(1, self.kv_heads, context)
                    k, v = rt.store.rows(layer, step.block_table[r : r + 1], positions)
                    ks.append(k[0].transpose(0, 1))
                    vs.append(v[0].transpose(0, 1))
            rt.store.bytes_read = read
            ops.cpu_attn_reshape_and_cache(torch.cat(ks).to(self.dtype), torch.cat(vs).to(self.dtype), key_cache,
                                           value_cache, meta.context_slots, self.isa)  # fmt: skip
        rows = meta.tokens
        q, k, v = query[rows], key[rows], value[rows]
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, meta.new_slots, self.isa)
        out = output[rows] if isinstance(rows, slice) else torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=meta.query_start,
            seq_lens=meta.seq_lens, scale=rt.adapter.scaling(layer), causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=meta.table, softcap=0.0, scheduler_metadata=meta.scheduler, s_aux=None,
        )  # fmt: skip
        if not isinstance(rows, slice):
            output[rows] = out

    @property
    def nbytes(self) -> int:
        """The staging cache, a prompt step's transient copy."""
        return 0 if self._staging is None else self._staging.nbytes


class InfiniGenMetadataBuilder(AttentionMetadataBuilder[InfiniGenMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # decodes first: the prompts are one run of rows
        heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.engine = VllmEngine(vllm_config, kv_cache_spec, heads)
        plugin.set_engine(self.engine)

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
        step.engine = self.engine.prepare(step, m.query_start_loc[: r + 1], m.seq_lens[:r])
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
