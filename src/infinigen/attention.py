"""The attention function a session registers, and the math of attending over a selection.

The session's pre-hook hands each attention call the cache layer it belongs to (the
``infinigen_layer`` keyword, passed through the model's own ``**kwargs``); that layer decides
how to attend. Without one (a plain cache inside a session) this is ordinary sdpa attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import infinigen.kernels as kernels
from infinigen.speculate import all_valid, is_all_valid

ATTN_NAME = "infinigen"


def infinigen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    infinigen_layer=None,
    **kwargs,
):
    """query [B, H, q, d]; key, value: what the layer's `update` returned [B, Hkv, k, d]."""
    if infinigen_layer is None:
        return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return infinigen_layer.attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def dense_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The model's own attention (sdpa) over every key it is given."""
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def attention_scaling(query: torch.Tensor, scaling: float | None) -> float:
    """The scale of the scores: the model's own when it passes one, else 1/sqrt(head dim) (the
    default every attention implementation applies; one rule for every caller)."""
    return query.shape[-1] ** -0.5 if scaling is None else scaling


# The most bytes of stored rows widened to fp32 at a time (`attend_stored`): a transient this size
# lives during a layer's attention instead of a widened copy of all its rows. The size is one that
# stays in a core's L2 cache (docs/results.md has the sizes compared).
WIDEN_BYTES = 512 << 10


def widen_rows(rows: torch.Tensor) -> int:
    """How many positions of `rows` [B, Hkv, n, d] `attend_stored` widens at a time: every one
    when they are fp32 already (nothing is copied), else as many as `WIDEN_BYTES` holds in fp32."""
    if rows.dtype == torch.float32:
        return max(rows.shape[2], 1)
    b, hkv, _, d = rows.shape
    return max(1, WIDEN_BYTES // max(b * hkv * d * 4, 1))


def attend_stored(
    query: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],
    valid: torch.Tensor,
    new: tuple[torch.Tensor, torch.Tensor],
    scaling: float,
    weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of one decode position over stored rows, in the dtype they are stored in, and
    over its own new position as computed: the rows are widened to fp32 in the C kernel's
    registers (`kernels.attend`), or without it a slice of `widen_rows` positions at a time, so
    the transfer buffers can hold them in 16 bits with no fp32 copy of the layer's rows. The
    scores of every row are kept (they are G / d of the rows' size), so the softmax is exact,
    not carried.

    query [B, H, 1, d]; rows (k, v) [B, Hkv, n, d]; valid [B, Hkv, n] (False: a padding slot or
    a position that is not there); new (k, v) [B, Hkv, 1, d]. Returns the output [B, 1, H, d] in
    the query's dtype and, when `weights`, the weights [B, H, 1, n + 1] (the new position last)."""
    b, h, _, d = query.shape
    k_rows, v_rows = rows
    hkv, n = k_rows.shape[1], k_rows.shape[2]
    q = query.reshape(b, hkv, h // hkv, d).to(torch.float32) * scaling  # head j of KV head j // G
    if kernels.can_attend(rows) and not weights:  # the rows read where they lie, on the compute's threads
        positions = counts = None
        if not is_all_valid(valid):
            order = torch.argsort((~valid).to(torch.uint8), dim=-1, stable=True)  # the valid slots first
            positions = order
            counts = valid.sum(-1)
        out = kernels.attend_rows(
            kernels.KVRows.contiguous(k_rows, v_rows), q, torch.full((b,), n), positions, counts,
            (new[0].reshape(b, hkv, d), new[1].reshape(b, hkv, d)),
        )  # fmt: skip
        return out.to(query.dtype).reshape(b, 1, h, d), None
    if kernels.can_attend(rows):  # the same math, the rows widened in registers (attend.c), with the weights
        out, probs = kernels.attend(q, rows, None if is_all_valid(valid) else valid, new, weights)
        return out.to(query.dtype).reshape(b, 1, h, d), probs.reshape(b, h, 1, n + 1) if weights else None
    step = widen_rows(k_rows)
    scores = torch.empty(b, hkv, h // hkv, n + 1, dtype=torch.float32, device=query.device)
    for start in range(0, n, step):
        stop = min(start + step, n)
        scores[..., start:stop] = torch.matmul(q, k_rows[:, :, start:stop].to(torch.float32).transpose(-1, -2))
    scores[..., n:] = torch.matmul(q, new[0].to(torch.float32).transpose(-1, -2))
    if not is_all_valid(valid):
        scores[..., :n].masked_fill_(~valid[:, :, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs[..., n:], new[1].to(torch.float32))  # [B, Hkv, G, d]
    for start in range(0, n, step):
        stop = min(start + step, n)
        out += torch.matmul(probs[..., start:stop], v_rows[:, :, start:stop].to(torch.float32))
    out = out.to(query.dtype).reshape(b, 1, h, d)
    return out, probs.reshape(b, h, 1, n + 1) if weights else None


class Part(NamedTuple):
    """Attention of one decode position over some of its rows, normalized among them, and the
    log of that normalizer (the log-sum-exp of their scores): two parts `merge` into attention
    over the rows of both, so a layer can attend its rows in pieces as they arrive."""

    out: torch.Tensor  # [B, Hkv, G, d] float32
    lse: torch.Tensor  # [B, Hkv, G, 1] float32; -inf where the part attended nothing


def own_part(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Part:
    """The step's own position as a part: q [B, Hkv, G, d] float32, already scaled; key, value
    [B, Hkv, 1, d] as computed. It is always attended, so a merge that starts from it is finite."""
    b, hkv, g, d = q.shape
    lse = torch.matmul(q, key.to(torch.float32).transpose(-1, -2))  # [B, Hkv, G, 1]
    return Part(value.to(torch.float32).expand(b, hkv, g, d), lse)


def attend_part(q: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor], valid: torch.Tensor | None) -> Part:
    """Attention of q [B, Hkv, G, d] (float32, already scaled) over stored rows (k, v)
    [B, Hkv, n, d] alone; valid [B, Hkv, n] or None (every row). The rows are widened in the C
    kernel's registers (`kernels.attend_part`), else by tensor operations."""
    if kernels.can_attend(rows):
        return Part(*kernels.attend_part(q, rows, valid))
    scores = torch.matmul(q, rows[0].to(torch.float32).transpose(-1, -2))  # [B, Hkv, G, n]
    if valid is not None:
        scores = scores.masked_fill(~valid[:, :, None, :], -math.inf)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(top == -math.inf, torch.zeros_like(top), top)  # nothing valid: an empty part
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights, rows[1].to(torch.float32)) / total.clamp_min(torch.finfo(torch.float32).tiny)
    return Part(out, top + torch.log(total))


def merge(a: Part, b: Part) -> Part:
    """Attention over the rows of both parts (at least one of them attended something)."""
    top = torch.maximum(a.lse, b.lse)
    wa, wb = torch.exp(a.lse - top), torch.exp(b.lse - top)
    total = wa + wb
    return Part((a.out * wa + b.out * wb) / total, top + torch.log(total))


def attend_in_chunks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    first: tuple[torch.Tensor, torch.Tensor],
    past: int,
    chunk: int,
    issue: Callable[[int, int, bool], Callable[[], tuple[torch.Tensor, torch.Tensor]]],
    valid: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one decode position over every past row, read `chunk` positions at a time,
    and over itself: while one chunk is attended (as stored, `attend_part`) the next is read
    into the other buffer, and each part is merged into the softmax carried from the new token
    on (`merge`), so the result is exact, in fp32, with two chunks held instead of the layer.

    query [B, H, 1, d]; key, value [B, Hkv, 1, d] the new token; `first`: the rows of positions
    [0, chunk); `issue(start, stop, second)` starts the read of [start, stop) into the first or
    second buffer and returns what waits for its rows; valid [B, Hkv, past] or None (every row).
    Output [B, 1, H, d]."""
    b, h, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, h // hkv, d).to(torch.float32) * scaling
    carried = own_part(q, key, value)  # always attended: the carried softmax is finite
    rows, start, second = first, 0, False
    while start < past:
        stop = min(start + chunk, past)
        wait_next = None
        if stop < past:  # the next chunk lands in the other buffer while this one is attended
            second = not second
            wait_next = issue(stop, min(stop + chunk, past), second)
        carried = merge(carried, attend_part(q, rows, None if valid is None else valid[:, :, start:stop]))
        if wait_next is not None:
            rows = wait_next()
        start = stop
    return carried.out.to(query.dtype).reshape(b, 1, h, d)


def key_validity(attention_mask: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """[B, Hkv, n]: which of the n stored rows [B, Hkv, n, d] a decode position may attend, read
    from the model's boolean mask over those rows and itself ([B or 1, 1, 1, n + 1]; None: all of
    them); None when the mask is of another kind (an additive float mask)."""
    b, hkv, n = rows.shape[:3]
    if attention_mask is None:
        return all_valid(b, hkv, n, rows.device)
    if attention_mask.dtype != torch.bool:
        return None
    return attention_mask[:, 0, -1, :n].to(rows.device)[:, None, :].expand(b, hkv, n)


def register_attention() -> None:
    """Make "infinigen" a valid attn_implementation (idempotent; a global registry, not the model)."""
    AttentionInterface.register(ATTN_NAME, infinigen_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
