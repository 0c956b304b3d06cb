"""InfiniGen per layer and per step over vLLM's paged KV, with no vLLM import (so it is tested
against dense attention where vLLM is not installed).

What lives where:
- vLLM's page (the pool vLLM sizes and sees) holds, per (block, KV head), only the partial keys of
  the block's positions as 4-bit codes (channel-pair rows of `block_size` bytes) followed by their
  float16 scales: the layout the selection kernel reads in place through vLLM's block table
  (`infinigen.kernels`, select.c). Each request's channel means and scales (measured on its prompt,
  as the library does) are kept beside it, keyed by the request's first block.
- `TierStore`, the slow tier, holds the full K/V of every layer in vLLM's own block layout
  ([blocks, KV heads, 2 * block_size, d]: a block's keys, then its values), addressed by vLLM's
  slots (block * block_size + offset): vLLM's block lifecycle governs it. A slot is read only by
  the request that wrote it (no prefix caching), so a freed block needs no clearing.
- A decode step of a speculated layer is one native call for the whole batch
  (`kernels.paged_decode`): the new tokens' K/V into the tier and their codes into the page, the
  speculated and own queries onto the partial channels, the selection over the page's codes (the
  library's rule), and the attention over the chosen rows where the tier keeps them, on torch's own
  threads.
- The layers that read every row (the first `dense_layers`; every layer under policy "full") are
  attended by the engine's own kernel where the backend hands one in (`engine`): their tier is kept
  in the engine's own layout and read in place, prompts and decodes alike. Without an engine (the
  tests), the same native call attends every row of the tier's row layout.
- A speculated layer's prompt attends itself densely: through the engine's kernel over a staging
  copy in its layout, else through torch's.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import infinigen.kernels as kernels
from infinigen.attention import attend_stored
from infinigen.roles import Role
from infinigen.select import make_selector
from infinigen.select.oracle import KeyCopy, OracleSelector
from infinigen.select.quantized import channel_means, channel_scales, quantize
from infinigen.speculate import channel_count

SCALE_BYTES = 2  # the float16 scale of one position's codes


def page_bytes(channels: int, itemsize: int = 2) -> int:
    """Bytes of vLLM's page per (KV head, token): the int4 codes of `channels` partial channels and
    their float16 scale, rounded up to whole elements of the page's dtype (`itemsize` bytes: vLLM
    views the page in the model's dtype)."""
    n = (channels + 1) // 2 + SCALE_BYTES
    return -(-n // itemsize) * itemsize


def placeholder_bytes(itemsize: int = 2) -> int:
    """The page of a policy that keeps nothing with the compute (full fetch): vLLM needs one element."""
    return itemsize


@dataclass
class StepRequests:
    """One forward step's requests, as vLLM's metadata gives them (read into lists once a step).

    query_start: R + 1 offsets of each request's rows; seq_lens: R total lengths (its context and
    its rows); block_table: [R, blocks] vLLM's block ids (int32); slots: [N] each row's slot.
    `plan` holds what the runtime derives from them once per step (its decode requests)."""

    query_start: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slots: torch.Tensor
    plan: DecodePlan | None = field(default=None, repr=False)
    engine: object = field(default=None, repr=False)  # the engine's own metadata, if it attends prompts

    def rows(self, r: int) -> tuple[int, int]:
        return self.query_start[r], self.query_start[r + 1]

    def decodes(self, r: int) -> bool:
        """Whether request r decodes (one new row over a context), else it is a prompt or a chunk of one."""
        return self.query_start[r + 1] - self.query_start[r] == 1 and self.seq_lens[r] > 1

    def prompts(self) -> list[int]:
        """The step's prompts (once a step: every layer asks)."""
        held = self.__dict__.get("_prompts")
        if held is None:
            held = self.__dict__["_prompts"] = [r for r in range(len(self.seq_lens)) if not self.decodes(r)]
        return held


class TierStore:
    """The full K/V of every layer in vLLM's block layout, [blocks, Hkv, 2 * block_size, d] per
    layer (a block's keys, then its values), in the KV's storage dtype. The operating system commits
    a page of it when a request first writes there, so it takes the memory of the blocks written,
    not of the whole pool (an address space it cannot reserve is refused in one line)."""

    def __init__(self, blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.blocks, self.block_size, self.kv_heads, self.head_dim, self.dtype = (
            blocks,
            block_size,
            kv_heads,
            head_dim,
            dtype,
        )
        self._kv: dict[int, torch.Tensor] = {}
        self.bytes_read = 0
        self.written = torch.zeros(blocks * block_size, dtype=torch.bool)  # slots any request has written

    @property
    def slots(self) -> int:
        return self.blocks * self.block_size

    def layer(self, layer: int) -> torch.Tensor:
        held = self._kv.get(layer)
        if held is None:
            shape = (self.blocks, self.kv_heads, 2 * self.block_size, self.head_dim)
            try:
                held = torch.empty(shape, dtype=self.dtype)
            except RuntimeError as exc:
                raise MemoryError(
                    f"the slow tier cannot reserve {math.prod(shape) * self.dtype.itemsize / 2**30:.1f} GiB of "
                    f"address space for layer {layer}'s K/V over vLLM's {self.slots} slots ({exc}); give vLLM fewer "
                    "blocks (--num-gpu-blocks-override, or less KV memory)"
                ) from None
            self._kv[layer] = held
        return held

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value [n, Hkv, d] at `slots` [n] (int64)."""
        kv = self.layer(layer)
        self.written[slots] = True
        blk, off = slots // self.block_size, slots % self.block_size
        kv[blk, :, off] = key.to(self.dtype)
        kv[blk, :, off + self.block_size] = value.to(self.dtype)

    def rows(self, layer: int, tables: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at `positions` [R, Hkv, n] of requests whose blocks are `tables` [R, blocks]
        (head h's at its own positions) -> (k, v) [R, Hkv, n, d], counted as read."""
        kv = self.layer(layer)
        r, hkv, n = positions.shape
        bs = self.block_size
        blk = tables.to(torch.long).gather(1, (positions // bs).reshape(r, -1)).view_as(positions)
        heads = torch.arange(hkv).view(1, hkv, 1).expand_as(positions)
        off = positions % bs
        k, v = kv[blk, heads, off], kv[blk, heads, off + bs]
        self.bytes_read += 2 * k.numel() * k.element_size()
        return k, v

    def written_bytes(self) -> int:
        """The K/V of every slot written so far, in every layer held: what the tier holds."""
        per_slot = 2 * self.kv_heads * self.head_dim * self.dtype.itemsize
        return int(self.written.sum()) * per_slot * len(self._kv)

    def reserved_bytes(self) -> int:
        """The address space reserved (what is resident is the written slots' pages)."""
        return sum(t.nbytes for t in self._kv.values())


class PageCodes:
    """Partial keys in vLLM's page: per (block, KV head), the block's codes as `pairs` rows of
    `block_size` bytes (channel-pair rows, two 4-bit codes a byte) then its float16 scales."""

    def __init__(self, channels: int, block_size: int) -> None:
        self.channels, self.block_size = channels, block_size
        self.pairs = (channels + 1) // 2

    def write(self, page: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """codes [Hkv, pairs, n] uint8, scales [Hkv, 1, n] float16, at `slots` [n] of `page`
        ([blocks, Hkv, block_size, C] bytes)."""
        bs, pairs = self.block_size, self.pairs
        flat = page.view(page.shape[0], page.shape[1], -1)
        hkv, n = codes.shape[0], codes.shape[-1]
        blk, off = slots // bs, slots % bs
        heads = torch.arange(hkv).view(hkv, 1, 1)
        at = torch.arange(pairs).view(1, pairs, 1) * bs + off.view(1, 1, n)
        flat[blk.view(1, 1, n), heads, at] = codes
        halves = scales.reshape(hkv, n).contiguous().view(torch.uint8).view(hkv, 1, n, 2)  # little-endian bytes
        at = pairs * bs + 2 * off.view(1, 1, n, 1) + torch.arange(2).view(1, 1, 1, 2)
        flat[blk.view(1, 1, n, 1), heads.view(hkv, 1, 1, 1), at] = halves

    def read(self, page: torch.Tensor, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of requests whose blocks are `tables` [R, blocks]: (codes
        [R, Hkv, pairs, length] uint8, scales [R, Hkv, 1, length] float16), as the library keeps
        them (the oracle's and the tests' view; the decode reads the page in place)."""
        bs, pairs = self.block_size, self.pairs
        flat = page.view(page.shape[0], page.shape[1], -1)
        nb = -(-length // bs)
        chunks = flat[tables[:, :nb].to(torch.long)]  # [R, nb, Hkv, bs * C]
        r, _, hkv, _ = chunks.shape
        codes = chunks[..., : pairs * bs].view(r, nb, hkv, pairs, bs).permute(0, 2, 3, 1, 4).reshape(r, hkv, pairs, -1)
        scales = chunks[..., pairs * bs : (pairs + 2) * bs].contiguous().view(torch.float16)  # [R, nb, Hkv, bs]
        scales = scales.permute(0, 2, 1, 3).reshape(r, hkv, 1, -1)
        return codes[..., :length].contiguous(), scales[..., :length].contiguous()

    def locate(self, page: torch.Tensor, tables: torch.Tensor) -> kernels.Codes:
        """Where the kernels find the codes: through `tables` [R, blocks] (int32, rows contiguous)."""
        if not page.is_contiguous():
            raise ValueError("vLLM's page must be contiguous [blocks, KV heads, block_size, C]")
        row = page.shape[-1] * page.shape[-2]  # bytes per (block, head)
        hkv = page.shape[1]
        return kernels.Codes(
            page.data_ptr(), page.data_ptr() + self.pairs * self.block_size, tables.data_ptr(), tables.stride(0),
            0, row, hkv * row, 0, row, hkv * row, self.block_size, self.block_size, self.pairs,
        )  # fmt: skip


class Adapter:
    """What the library's selector may know of a model served by an engine (`infinigen.models`'
    interface, for the parts the selector reads): shapes, scaling, and how a projected query
    becomes heads at its positions (the engine's own rotary embedding, `rotary(layer, positions,
    q)` on [T, H·d])."""

    def __init__(
        self, num_layers, num_heads, num_kv_heads, head_dim, scale, rotary: Callable, rope: Callable | None = None
    ) -> None:
        """rope(layer): the layer's rotary table as the kernel applies it, (cos_sin [positions, rot]
        float32: cos then sin, rot / 2 each; rot; NeoX-style), or None (then `rotary` runs)."""
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = (
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self._scale, self._rotary, self._rope = scale, rotary, rope
        self.model = nn.Module()  # the selector asks where layers compute: here, the CPU
        self.model.anchor = nn.Parameter(torch.empty(0), requires_grad=False)

    def is_local(self, layer: int) -> bool:
        return False

    def attention_modules(self) -> list[nn.Module]:
        return [nn.Module() for _ in range(self.num_layers)]

    def scaling(self, layer: int) -> float:
        return self._scale

    def rope(self, layer: int) -> tuple[torch.Tensor, int, bool] | None:
        return None if self._rope is None else self._rope(layer)

    def query_heads(self, layer: int, projected: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """projected [B, T, H·d] -> [B, H, T, d] post-RoPE (float32)."""
        b, t, _ = projected.shape
        q = self._rotary(layer, positions, projected.reshape(b * t, -1).to(torch.float32))
        return q.reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)


@dataclass
class Counters:
    """What the plugin did, for a benchmark to read: decode rows attended and read."""

    decode_steps: int = 0  # decode tokens (requests x steps) summed over layers
    rows_attended: int = 0
    rows_context: int = 0  # every row the same tokens would have attended densely
    codes_read: int = 0  # bytes of partial-key codes the selection read in vLLM's page
    per_layer_rows: dict[int, int] = field(default_factory=dict)


class RequestStats:
    """Each request's channel means and scales of its partial keys, [layers, Hkv, 2, c] float32,
    measured on its prompt and kept beside vLLM's page, keyed by the request's first block (a new
    request there replaces them). The least recently used beyond `keep` are dropped: vLLM schedules
    every running request each step, so a request unseen for that many is gone."""

    def __init__(self, layers: int, kv_heads: int, channels: int, keep: int = 1024) -> None:
        self.shape, self.keep = (layers, kv_heads, 2, channels), keep
        self._held: OrderedDict[int, torch.Tensor] = OrderedDict()

    def measure(self, first: int, layer: int, partial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt's first chunk's partial keys [1, Hkv, n, c] set the request's (mu, sigma) of `layer`
        (a request that held the block before has every speculated layer replaced in the same step)."""
        held = self._held.get(first)
        if held is None:
            held = self._held[first] = torch.zeros(self.shape)
        self._held.move_to_end(first)
        real = torch.ones(1, partial.shape[2], dtype=torch.bool)
        mu = channel_means(partial, real)
        held[layer, :, 0] = mu[0]
        held[layer, :, 1] = channel_scales(partial - mu[:, :, None, :], real)[0]
        self._trim()
        return held[layer, :, 0][None], held[layer, :, 1][None]

    def get(self, first: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._need(first)
        return held[layer, :, 0][None], held[layer, :, 1][None]

    def stack(self, firsts: list[int]) -> torch.Tensor:
        """[R, layers, Hkv, 2, c] for the step's decode requests (once a step)."""
        out = torch.stack([self._need(f) for f in firsts])
        for f in firsts:
            self._held.move_to_end(f)
        return out

    def _need(self, first: int) -> torch.Tensor:
        held = self._held.get(first)
        if held is None:
            raise RuntimeError(
                f"infinigen: no partial-key statistics for the request at block {first}: its prompt was not seen "
                "(a request vLLM resumed from another process?)"
            )
        return held

    def _trim(self) -> None:
        while len(self._held) > self.keep:
            self._held.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._held.values())


@dataclass
class DecodePlan:
    """What a step's decode requests share across layers, derived once a step: their token rows,
    slots, contexts and block tables in the kernels' types, their partial-key statistics, the
    selection's output buffers, and the native call's arguments (filled per layer)."""

    requests: list[int]
    rows: torch.Tensor  # int64 [R]
    slots: torch.Tensor  # int64 [R]
    lengths: torch.Tensor  # int64 [R] positions before the new token
    tables: torch.Tensor  # int32 [R, blocks]
    firsts: list[int]
    stats: torch.Tensor | None  # [R, layers, Hkv, 2, c] float32
    positions: torch.Tensor  # int64 [R * Hkv, longest]
    counts: torch.Tensor
    extra: torch.Tensor
    work: torch.Tensor
    call: kernels.PagedStep
    context_rows: int = 0  # (request, KV head) rows of every context: what dense attention reads

    @property
    def contiguous_rows(self) -> bool:
        return self.requests == list(range(len(self.requests)))


class Runtime:
    """One process's plugin state: the config's roles and selector, the store, the partial keys'
    codec, and each layer's last input (for the next layer's speculation)."""

    def __init__(self, settings, adapter: Adapter, artifact, block_size: int, slots: int, dtype: torch.dtype):
        self.settings, self.adapter, self.block_size = settings, adapter, block_size
        config = settings.config
        self.roles = config.layer_roles(adapter)
        self.selector = make_selector(config, adapter, artifact) if settings.selects else None
        blocks = slots // block_size
        self.store = TierStore(
            blocks, block_size, adapter.num_kv_heads, adapter.head_dim, config.storage_dtype() or dtype
        )
        self.channels = channel_count(config.partial_ratio, adapter.head_dim)
        self.codes = PageCodes(self.channels, block_size)
        self.stats = RequestStats(adapter.num_layers, adapter.num_kv_heads, self.channels)
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (x [N, D], positions [N])
        self.counters = Counters()
        # the engine's own attention (`backend.VllmEngine`), set by the backend: the layers that read
        # every row keep their tier in its layout and are attended by it; prompts are attended by it
        self.engine = None
        self._proj: dict[int, torch.Tensor] = {}
        self._rules: dict[int, kernels.Rule] = {}
        self._buffers: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ the engine's calls
    def saw_input(self, layer: int, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Layer `layer`'s normalized attention input, before its attention (the hook's call)."""
        self.inputs[layer] = (x, positions)

    def forward(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        page: torch.Tensor,
        step: StepRequests,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """One layer's attention for every request of the step. query [N, H, d], key/value
        [N, Hkv, d] (post-RoPE, as vLLM computed them); page [blocks, Hkv, block_size, C] bytes;
        output [N, H, d] is written."""
        plan = step.plan if step.plan is not None else self._plan(step)
        selects = self.roles[layer] == Role.SELECT and self.selector is not None
        if not selects and self.engine is not None and step.engine is not None:
            # every row, read in place by the engine's own kernel in its own layout
            self.engine.every_row(self, layer, query, key, value, step, output)
            if plan.requests:
                self._count(layer, plan, 0)
            self.inputs.pop(layer - 1, None)
            return output
        codes = selects and self.settings.keeps_partial_keys
        prompts = step.prompts()
        if prompts:
            self._prompts(layer, prompts, query, key, value, page, step, output, codes)
        if plan.requests:
            if selects and isinstance(self.selector, OracleSelector):
                self._decode_oracle(layer, plan, query, key, value, output)
            else:
                self._decode(layer, plan, query, key, value, page if codes else None, output)
        self.inputs.pop(layer - 1, None)  # read once: a prefill's inputs are large
        return output

    # ------------------------------------------------------------------ prompts
    def _prompts(self, layer, prompts, query, key, value, page, step, output, codes) -> None:
        """Prompts (and their later chunks): stored, their partial keys coded, attended densely."""
        for r in prompts:
            start, stop = step.rows(r)
            slots = step.slots[start:stop].to(torch.long)
            self.store.write(layer, slots, key[start:stop], value[start:stop])
            if codes:
                context = step.seq_lens[r] - (stop - start)
                self._write_prompt_codes(layer, page, int(step.block_table[r, 0]), slots, key[start:stop], context == 0)
        if self.engine is not None and step.engine is not None:
            self.engine.prompts(self, layer, prompts, query, key, value, step, output)
            return
        for r in prompts:
            start, stop = step.rows(r)
            context = step.seq_lens[r] - (stop - start)
            if context == 0:
                output[start:stop] = self._prefill(layer, query[start:stop], key[start:stop], value[start:stop])
            else:  # a later chunk (chunked prefill): dense over what is stored and itself
                read = self.store.bytes_read  # a prefill's reads are not a decode step's
                positions = torch.arange(context).expand(1, self.adapter.num_kv_heads, context)
                k, v = self.store.rows(layer, step.block_table[r : r + 1], positions)
                self.store.bytes_read = read
                output[start:stop] = self._prefill(layer, query[start:stop], key[start:stop], value[start:stop], (k, v))

    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stored=None) -> torch.Tensor:
        """Causal attention of a prompt's rows over themselves (and over the `stored` rows of its
        earlier chunks, (k, v) [1, Hkv, context, d]), in float32."""
        qf, kf, vf = (t.transpose(0, 1)[None].to(torch.float32) for t in (q, k, v))
        mask, causal = None, True
        if stored is not None:
            context, n = stored[0].shape[2], q.shape[0]
            kf = torch.cat([stored[0].to(torch.float32), kf], 2)
            vf = torch.cat([stored[1].to(torch.float32), vf], 2)
            mask = torch.arange(context + n)[None, :] <= torch.arange(n)[:, None] + context
            causal = False
        out = torch.nn.functional.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=mask, is_causal=causal, scale=self.adapter.scaling(layer), enable_gqa=True
        )
        return out[0].transpose(0, 1).to(q.dtype)

    def _write_prompt_codes(self, layer, page, first, slots, keys, prefill: bool) -> None:
        """A prompt's partial keys; its first chunk measures the channel means and scales."""
        kp = self._partial(layer, keys).transpose(0, 1)[None]  # [1, Hkv, n, c]
        if prefill:
            mu, sigma = self.stats.measure(first, layer, kp)
        else:
            mu, sigma = self.stats.get(first, layer)
        codes, scales = quantize(kp - mu[:, :, None, :], sigma, "int4")
        self.codes.write(page, slots, codes[0], scales[0])

    def _partial(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """keys [n, Hkv, d] on the layer's skewed partial channels -> [n, Hkv, c] float32."""
        return torch.matmul(keys.transpose(0, 1).to(torch.float32), self.selector.proj[layer]).transpose(0, 1)

    # ------------------------------------------------------------------ decode
    def _plan(self, step: StepRequests) -> DecodePlan:
        """The step's decode requests (one new row over a context), once a step."""
        requests = [r for r in range(len(step.seq_lens)) if step.decodes(r)]
        rows = torch.tensor([step.query_start[r] for r in requests], dtype=torch.int64)
        lengths = torch.tensor([step.seq_lens[r] - 1 for r in requests], dtype=torch.int64)
        slots = step.slots[rows].to(torch.int64) if requests else rows.clone()
        tables = step.block_table[requests].to(torch.int32).contiguous()
        firsts = [int(b) for b in tables[:, 0]] if requests else []
        stats = None
        if requests and self.settings.keeps_partial_keys and self.selector is not None:
            stats = self.stats.stack(firsts)
        hkv, h, d = self.adapter.num_kv_heads, self.adapter.num_heads, self.adapter.head_dim
        r = len(requests)
        longest = int(lengths.max()) if r else 1
        positions = self._buffer("positions", (r * hkv, longest), torch.int64)
        counts = self._buffer("counts", (r * hkv,), torch.int64)
        extra = self._buffer("extra", (r * hkv,), torch.int64)
        work = self._buffer("work", (kernels.paged_work(r, h, hkv, d, self.channels),), torch.float32)
        call = kernels.PagedStep()
        call.R, call.H, call.Hkv, call.d, call.C, call.pairs, call.bs = (
            r,
            h,
            hkv,
            d,
            self.channels,
            self.codes.pairs,
            self.block_size,
        )
        call.rows, call.slots, call.lengths = rows.data_ptr(), slots.data_ptr(), lengths.data_ptr()
        call.tables, call.table_ld = tables.data_ptr(), tables.stride(0) if r else 1
        call.store_format = kernels.KEY_FORMATS[self.store.dtype]
        call.positions, call.counts, call.extra, call.ldp = (
            positions.data_ptr(), counts.data_ptr(), extra.data_ptr(), positions.shape[-1],
        )  # fmt: skip
        call.work, call.write_kv, call.threads = work.data_ptr(), 1, kernels.threads()
        self.store.written[slots] = True  # the kernel writes them in every layer
        step.plan = DecodePlan(
            requests, rows, slots, lengths, tables, firsts, stats, positions, counts, extra, work, call
        )
        return step.plan

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A step buffer kept across steps, grown when a step needs more."""
        n = math.prod(shape)
        held = self._buffers.get(name)
        if held is None or held.numel() < n:
            held = torch.empty(max(n, 1) + n // 4, dtype=dtype)
            self._buffers[name] = held
        return held[:n].view(shape)

    def _proj_of(self, layer: int) -> torch.Tensor:
        held = self._proj.get(layer)
        if held is None:
            held = self._proj[layer] = self.selector.proj[layer].to(torch.float32).contiguous()
        return held

    def _decode(self, layer, plan: DecodePlan, query, key, value, page, output) -> None:
        """The step's decode tokens in one native call (`kernels.paged_decode`): a few field writes
        and one call a layer."""
        call = plan.call
        for t in (query, key, value, output):
            if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
                raise ValueError("infinigen: vLLM's query, key, value and output rows must have contiguous heads")
        call.q, call.k, call.v, call.out = query.data_ptr(), key.data_ptr(), value.data_ptr(), output.data_ptr()
        call.q_row, call.k_row, call.v_row, call.out_row = (
            query.stride(0),
            key.stride(0),
            value.stride(0),
            output.stride(0),
        )
        call.io_format = kernels.KEY_FORMATS[query.dtype]
        call.store = self.store.layer(layer).data_ptr()
        call.scaling = self.adapter.scaling(layer)
        spec = None
        if page is not None:
            spec, rope = self._speculated(layer, plan, query)  # held until the call returns
            call.cos_sin, call.rot, call.neox = (
                (None, 0, 0) if rope is None else (rope[0].data_ptr(), rope[1], int(rope[2]))
            )
            stats = plan.stats[:, layer]
            call.page, call.page_row = page.data_ptr(), page.shape[-1]
            call.proj = self._proj_of(layer).data_ptr()
            call.mu = stats.data_ptr()
            call.sigma = stats.data_ptr() + self.channels * 4  # [Hkv, 2, c]: sigma after mu
            call.spec = spec.data_ptr()
            call.rule = self._rule(layer)
            call.stats_stride, call.stats_head = plan.stats.stride(0), plan.stats.stride(2)
        else:
            call.page = None
        kernels.paged_decode(call)
        del spec
        self._count(layer, plan, 0 if page is None else page.shape[-1], call.attended if page is not None else 0)

    def _rule(self, layer: int) -> kernels.Rule:
        """The layer's selection rule (its budget, top-up and the selector's knobs), made once."""
        held = self._rules.get(layer)
        if held is None:
            sel = self.selector
            k = sel.knobs
            held = self._rules[layer] = kernels.Rule.of(
                k.aggregation, sel.alpha(layer), sel.speculated_budget(layer), k.budget_tokens, k.min_tokens, k.units,
                k.unit_score, sel.correction(layer),
            )  # fmt: skip
        return held

    def _speculated(self, layer: int, plan: DecodePlan, query: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """The speculated queries [R, H, d] float32 from layer i-1's input through the layer's
        fitted query map (or the layer's own query where the selector asks for it), and the rotary
        table the kernel applies to them (None: they are post-RoPE already)."""
        sel = self.selector
        if sel.query_from == "own" or layer - 1 not in self.inputs:
            return query[plan.rows].to(torch.float32).contiguous(), None
        x, positions = self.inputs[layer - 1]
        rows = plan.rows if not plan.contiguous_rows else slice(0, len(plan.requests))
        qmap, rope = sel.query_maps.get(layer), self.adapter.rope(layer)
        if qmap is not None and rope is not None:  # two operations; the kernel applies the rotary table
            return torch.addmm(qmap[-1], x[rows].to(torch.float32), qmap[:-1]), rope
        spec = sel.query(layer, x[rows][:, None, :], positions[rows])  # [R, H, 1, d]
        return spec[:, :, 0].to(torch.float32).contiguous(), None

    def _count(self, layer: int, plan: DecodePlan, page_row: int, attended: int = 0) -> None:
        """page_row: the page's bytes per position the selection read (0: every row attended);
        attended: the rows the selection chose (the kernel's count)."""
        r = len(plan.requests)
        context = plan.context_rows
        attended = attended if page_row else context
        c = self.counters
        c.codes_read += context * page_row
        c.decode_steps += r
        c.rows_attended += attended
        c.rows_context += context
        c.per_layer_rows[layer] = c.per_layer_rows.get(layer, 0) + attended
        self.store.bytes_read += attended * 2 * self.adapter.head_dim * self.store.dtype.itemsize

    def _decode_oracle(self, layer, plan: DecodePlan, query, key, value, output) -> None:
        """The quality bound: every key read to choose (not counted as read), the chosen rows attended."""
        sel, hkv, r = self.selector, self.adapter.num_kv_heads, len(plan.requests)
        self.store.write(layer, plan.slots, key[plan.rows], value[plan.rows])
        longest = int(plan.lengths.max())
        valid = (
            (torch.arange(longest)[None, :] < plan.lengths[:, None])[:, None, :].expand(r, hkv, longest).contiguous()
        )
        read = self.store.bytes_read
        every = torch.arange(longest).expand(r, hkv, longest)
        state = KeyCopy()
        state.buffer._buf = self.store.rows(layer, plan.tables, every)[0]
        state.buffer.length = longest
        self.store.bytes_read = read
        q = query[plan.rows].to(torch.float32)
        chosen = sel.select(state, layer, q, longest, valid)
        kv = self.store.rows(layer, plan.tables, chosen.indices)
        new = (key[plan.rows][:, :, None], value[plan.rows][:, :, None])
        out, _ = attend_stored(q[:, :, None], kv, chosen.valid, new, self.adapter.scaling(layer))
        output[plan.rows] = out[:, 0].to(output.dtype)
        attended = int(chosen.valid.sum())
        c = self.counters
        c.decode_steps += r
        c.rows_attended += attended
        c.rows_context += hkv * int(plan.lengths.sum())
        c.per_layer_rows[layer] = c.per_layer_rows.get(layer, 0) + attended

    # ------------------------------------------------------------------ reporting
    def describe(self) -> dict:
        c = self.counters
        return {
            "policy": self.settings.config.policy,
            "decode_layer_steps": c.decode_steps,
            "rows_attended": c.rows_attended,
            "rows_context": c.rows_context,
            "attended_share": c.rows_attended / c.rows_context if c.rows_context else math.nan,
            "bytes_read": self.store.bytes_read,
            "codes_read": c.codes_read,
            "store_reserved_bytes": self.store.reserved_bytes(),
            "store_written_bytes": self.store.written_bytes(),
            "request_stats_bytes": self.stats.nbytes,
            "kernel_path": kernels.isa(),
        }
