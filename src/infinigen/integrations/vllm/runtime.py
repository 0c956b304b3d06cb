"""InfiniGen per layer and per step over vLLM's paged KV, with no vLLM import (so it is tested
against dense attention where vLLM is not installed).

What lives where:
- vLLM's page (the pool vLLM sizes and sees) holds, per (block, KV head, token), only the partial
  key as 4-bit codes and a float16 scale (`infinigen.select.quantized`): what stays with the
  compute. Each request's channel means and scales (measured on its prompt, as the library does)
  are kept beside it, keyed by the request's first block.
- `SlotStore`, the slow tier, holds the full K/V, keyed by vLLM's slot ids (block * block_size +
  offset): vLLM's block lifecycle governs it. A slot is read only by the request that wrote it
  (no prefix caching), so a freed block needs no clearing.
- A decode step of a speculated layer scores the partial keys with the query speculated from the
  previous layer's input, selects (the library's selector and kernels, as in transformers),
  gathers the selected rows of the store into a step buffer bounded by the budget, and attends
  them with the token's own key and value.
The first `dense_layers` layers, and every layer under policy "full", attend every row of the
request from the store.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from infinigen.attention import attend_stored
from infinigen.roles import Role
from infinigen.select import make_selector
from infinigen.select.oracle import KeyCopy, OracleSelector
from infinigen.select.quantized import QuantizedPartialKeys, channel_means, channel_scales, quantize
from infinigen.speculate import all_valid, channel_count, is_all_valid

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
    its rows); block_table: [R, blocks] vLLM's block ids; slots: [N] each row's slot."""

    query_start: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slots: torch.Tensor

    def rows(self, r: int) -> tuple[int, int]:
        return self.query_start[r], self.query_start[r + 1]


class SlotStore:
    """The full K/V of every layer, head-major ([Hkv, slots, d] per layer and K/V), in the KV's
    storage dtype, over every slot of vLLM's pool. The operating system commits a page of it when a
    request first writes there, so it takes the memory of the slots written, not of the whole range
    (an address space it cannot reserve is refused in one line)."""

    def __init__(self, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.slots, self.kv_heads, self.head_dim, self.dtype = slots, kv_heads, head_dim, dtype
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bytes_read = 0
        self.written = torch.zeros(slots, dtype=torch.bool)  # slots any request has written

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._kv.get(layer)
        if held is None:
            shape = (self.kv_heads, self.slots, self.head_dim)
            try:
                held = (torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype))
            except RuntimeError as exc:
                raise MemoryError(
                    f"the slow tier cannot reserve {2 * math.prod(shape) * self.dtype.itemsize / 2**30:.1f} GiB of "
                    f"address space for layer {layer}'s K/V over vLLM's {self.slots} slots ({exc}); give vLLM fewer "
                    "blocks (--num-gpu-blocks-override, or less KV memory)"
                ) from None
            self._kv[layer] = held
        return held

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value [n, Hkv, d] at `slots` [n]."""
        k, v = self._layer(layer)
        self.written[slots] = True
        k[:, slots] = key.transpose(0, 1).to(self.dtype)
        v[:, slots] = value.transpose(0, 1).to(self.dtype)

    def rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `slots` [R, Hkv, n] (head h's at its own slots) -> (k, v) [R, Hkv, n, d]."""
        k, v = self._layer(layer)
        hkv = slots.shape[1]
        flat = (slots + torch.arange(hkv)[:, None] * k.shape[1]).reshape(-1)
        shape = (*slots.shape, self.head_dim)
        out = (
            k.view(-1, self.head_dim).index_select(0, flat).view(shape),
            v.view(-1, self.head_dim).index_select(0, flat).view(shape),
        )
        self.bytes_read += 2 * flat.numel() * self.head_dim * k.element_size()
        return out

    def written_bytes(self) -> int:
        """The K/V of every slot written so far, in every layer held: what the tier holds."""
        per_slot = 2 * self.kv_heads * self.head_dim * self.dtype.itemsize
        return int(self.written.sum()) * per_slot * len(self._kv)

    def reserved_bytes(self) -> int:
        """The address space reserved (what is resident is the written slots' pages)."""
        return sum(t.nbytes for kv in self._kv.values() for t in kv)


class PageCodes:
    """Partial keys in vLLM's page: per (block, KV head, token) the int4 codes then the float16
    scale (`page_bytes`)."""

    def __init__(self, channels: int) -> None:
        self.channels = channels
        self.code_bytes = (channels + 1) // 2

    def write(
        self, page: torch.Tensor, block_size: int, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
    ):
        """codes [Hkv, code_bytes, n] uint8, scales [Hkv, 1, n] float16, at `slots` [n] of `page`
        ([blocks, Hkv, block_size, C] bytes)."""
        blocks, offsets = slots // block_size, slots % block_size
        cb = self.code_bytes
        page[blocks, :, offsets, :cb] = codes.permute(2, 0, 1)
        page[blocks, :, offsets, cb : cb + SCALE_BYTES] = scales.permute(2, 0, 1).contiguous().view(torch.uint8)

    def read(self, page: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Requests' blocks `tables` [R, nb] -> (codes [R, Hkv, code_bytes, nb * block_size], scales
        [R, Hkv, 1, same] float16), channel-major and contiguous as the selection kernel reads them."""
        r, nb = tables.shape
        p = page.index_select(0, tables.reshape(-1))  # [R * nb, Hkv, bs, C]
        _, hkv, bs, _ = p.shape
        p = p.view(r, nb, hkv, bs, -1)
        cb = self.code_bytes
        codes = p[..., :cb].permute(0, 2, 4, 1, 3).reshape(r, hkv, cb, nb * bs).contiguous()
        scales = p[..., cb : cb + SCALE_BYTES].contiguous().view(torch.float16)  # [R, nb, Hkv, bs, 1]
        scales = scales.permute(0, 2, 4, 1, 3).reshape(r, hkv, 1, nb * bs).contiguous()
        return codes, scales


class Adapter:
    """What the library's selector may know of a model served by an engine (`infinigen.models`'
    interface, for the parts the selector reads): shapes, scaling, and how a projected query
    becomes heads at its positions (the engine's own rotary embedding, `rotary(layer, positions,
    q)` on [T, H·d])."""

    def __init__(self, num_layers, num_heads, num_kv_heads, head_dim, scale, rotary: Callable) -> None:
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = (
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self._scale, self._rotary = scale, rotary
        self.model = nn.Module()  # the selector asks where layers compute: here, the CPU
        self.model.anchor = nn.Parameter(torch.empty(0), requires_grad=False)

    def is_local(self, layer: int) -> bool:
        return False

    def attention_modules(self) -> list[nn.Module]:
        return [nn.Module() for _ in range(self.num_layers)]

    def scaling(self, layer: int) -> float:
        return self._scale

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
    per_layer_rows: dict[int, int] = field(default_factory=dict)


class Runtime:
    """One process's plugin state: the config's roles and selector, the store, the partial keys'
    codec, and each layer's last input (for the next layer's speculation)."""

    def __init__(self, settings, adapter: Adapter, artifact, block_size: int, slots: int, dtype: torch.dtype):
        self.settings, self.adapter, self.block_size = settings, adapter, block_size
        config = settings.config
        self.roles = config.layer_roles(adapter)
        self.selector = make_selector(config, adapter, artifact) if settings.selects else None
        self.store = SlotStore(slots, adapter.num_kv_heads, adapter.head_dim, config.storage_dtype() or dtype)
        self.codes = PageCodes(channel_count(config.partial_ratio, adapter.head_dim))
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (x [N, D], positions [N])
        self.stats: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, first block) -> mu, sigma
        self.counters = Counters()

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
        n = len(step.slots)
        slots = step.slots[:n].to(torch.long)
        self.store.write(layer, slots, key[:n], value[:n])
        selects = self.roles[layer] == Role.SELECT and self.selector is not None
        codes = selects and self.settings.keeps_partial_keys
        decoding = []
        for r in range(len(step.seq_lens)):
            start, stop = step.rows(r)
            length = step.seq_lens[r]
            context = length - (stop - start)
            if context > 0 and stop - start == 1:
                decoding.append(r)
                continue
            if codes:
                first = int(step.block_table[r, 0])
                self._write_prompt_codes(layer, page, first, slots[start:stop], key[start:stop], context == 0)
            if context == 0:
                output[start:stop] = self._prefill(layer, query[start:stop], key[start:stop], value[start:stop])
            else:  # a prompt's later chunk (chunked prefill): dense over what is stored and itself
                read = self.store.bytes_read  # a prefill's reads are not a decode step's
                blocks = step.block_table[r : r + 1, : -(-context // self.block_size)].to(torch.long)
                k, v = self._stored(layer, blocks, context)
                self.store.bytes_read = read
                output[start:stop] = self._prefill(layer, query[start:stop], key[start:stop], value[start:stop], (k, v))
        if decoding:
            self._decode(layer, decoding, query, key, value, page, step, output, selects, codes)
        self.inputs.pop(layer - 1, None)  # read once: a prefill's inputs are large
        return output

    # ------------------------------------------------------------------ pieces
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

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """vLLM's slots of `positions` [R, Hkv, n] of requests whose blocks are `tables` [R, blocks]."""
        r = positions.shape[0]
        blocks = tables.gather(1, (positions // self.block_size).reshape(r, -1)).view_as(positions)
        return blocks * self.block_size + positions % self.block_size

    def _stored(self, layer: int, tables: torch.Tensor, length: int):
        """Every stored row of positions [0, length) of requests (`tables` [R, blocks]), (k, v)
        [R, Hkv, length, d] (rows past a shorter request's context are whatever the slots hold)."""
        positions = torch.arange(length).expand(tables.shape[0], self.adapter.num_kv_heads, length)
        return self.store.rows(layer, self._slots(tables, positions))

    def _write_prompt_codes(self, layer, page, first, slots, keys, prefill: bool) -> None:
        """A prompt's partial keys; its first chunk measures the channel means and scales."""
        kp = self._partial(layer, keys).transpose(0, 1)[None]  # [1, Hkv, n, c]
        real = torch.ones(1, kp.shape[2], dtype=torch.bool)
        if prefill or (layer, first) not in self.stats:
            mu = channel_means(kp, real)
            self.stats[(layer, first)] = (mu, channel_scales(kp - mu[:, :, None, :], real))
        mu, sigma = self.stats[(layer, first)]
        codes, scales = quantize(kp - mu[:, :, None, :], sigma, "int4")
        self.codes.write(page, self.block_size, slots, codes[0], scales[0])

    def _partial(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """keys [n, Hkv, d] on the layer's skewed partial channels -> [n, Hkv, c] float32."""
        return torch.matmul(keys.transpose(0, 1).to(torch.float32), self.selector.proj[layer]).transpose(0, 1)

    def _decode(self, layer, decoding, query, key, value, page, step, output, selects, codes) -> None:
        """The step's decode tokens, batched: each attends the chosen rows of its context and its own
        key/value. Requests of different lengths are padded to the longest (masked)."""
        hkv = self.adapter.num_kv_heads
        rows = torch.tensor([step.query_start[r] for r in decoding])
        pasts = [step.seq_lens[r] - 1 for r in decoding]
        longest = max(pasts)
        firsts = [int(step.block_table[r, 0]) for r in decoding]
        tables = step.block_table[decoding, : -(-longest // self.block_size)].to(torch.long)
        mus, sigmas = None, None
        if codes:
            mus = torch.cat([self.stats[(layer, f)][0] for f in firsts])
            sigmas = torch.cat([self.stats[(layer, f)][1] for f in firsts])
            kp = self._partial(layer, key[rows])[:, :, None, :]  # [R, Hkv, 1, c]
            c, s = quantize(kp - mus[:, :, None, :], sigmas, "int4")  # [R, Hkv, cb, 1], [R, Hkv, 1, 1]
            self.codes.write(page, self.block_size, step.slots[rows].to(torch.long), c[..., 0].permute(1, 2, 0),
                             s[..., 0].permute(1, 2, 0))  # fmt: skip
        if len(set(pasts)) == 1:
            valid = all_valid(len(decoding), hkv, longest)
        else:
            valid = (torch.arange(longest)[None, :] < torch.tensor(pasts)[:, None])[:, None, :].expand(-1, hkv, -1)
            valid = valid.contiguous()
        q = query[rows]
        if selects:
            positions, ok = self._select(layer, rows, q, page, tables, longest, valid, mus, sigmas)
        else:
            positions, ok = torch.arange(longest).expand(len(decoding), hkv, longest), valid
        kv = self.store.rows(layer, self._slots(tables, positions))
        attended = int(ok.sum()) if not is_all_valid(ok) else ok.numel()
        counters = self.counters
        counters.decode_steps += len(decoding)
        counters.rows_attended += attended
        counters.rows_context += hkv * sum(pasts)
        counters.per_layer_rows[layer] = counters.per_layer_rows.get(layer, 0) + attended
        new = (key[rows][:, :, None], value[rows][:, :, None])
        out, _ = attend_stored(q[:, :, None], kv, ok, new, self.adapter.scaling(layer))
        output[rows] = out[:, 0]

    def _select(self, layer, rows, q, page, tables, past, valid, mus, sigmas):
        """The positions [R, Hkv, n] of [0, past) each token attends, and which slots are real."""
        sel = self.selector
        own = q.to(torch.float32)  # [R, H, d]
        if isinstance(sel, OracleSelector):  # the bound: every key read to choose (not counted as read)
            read = self.store.bytes_read
            state = KeyCopy()
            state.buffer._buf = self._stored(layer, tables, past)[0]
            state.buffer.length, self.store.bytes_read = past, read
            chosen = sel.select(state, layer, own, past, valid)
            return chosen.indices, chosen.valid
        state = QuantizedPartialKeys("int4")
        state.codes._buf, state.scales._buf = self.codes.read(page, tables)
        state.codes.length = state.scales.length = past
        state.mu, state.sigma = mus, sigmas
        if sel.query_from == "own" or layer - 1 not in self.inputs:
            spec = own
        else:
            x, positions = self.inputs[layer - 1]
            spec = sel.query(layer, x[rows][:, None, :], positions[rows])[:, :, 0]
        chosen = sel.select(state, layer, spec, past, valid)
        extra = sel.correct(state, layer, own, past, valid, chosen) if sel.correction(layer) > 0 else None
        idx, ok = chosen.indices, chosen.valid
        if extra is not None and extra.indices.shape[-1]:
            idx, ok = torch.cat([idx, extra.indices], -1), torch.cat([ok, extra.valid], -1)
        return idx, ok

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
            "store_reserved_bytes": self.store.reserved_bytes(),
            "store_written_bytes": self.store.written_bytes(),
        }
