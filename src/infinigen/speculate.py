"""Pure tensor math of speculation and selection (no model code).

Shapes: B batch, H query heads, Hkv KV heads (H = Hkv * G for a GQA group of size G),
T cached positions, c partial channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Selection:
    """Which cached positions each (batch, KV head) row fetches.

    indices: [B, Hkv, n] positions, ascending among the valid slots (padding slots hold 0).
    valid:   [B, Hkv, n] True where the slot is a real selection.
    context: number of non-padding cached positions per batch row, [B].
    """

    indices: torch.Tensor
    valid: torch.Tensor
    context: torch.Tensor

    @property
    def counts(self) -> torch.Tensor:
        return self.valid.sum(-1)

    def fraction(self) -> float:
        """Mean over (batch, KV head) rows of selected / context."""
        ctx = self.context.clamp(min=1).to(torch.float32)[:, None]
        return (self.counts.to(torch.float32) / ctx).mean().item()


def skew_partial(x: torch.Tensor, skew: torch.Tensor | None, channels: torch.Tensor) -> torch.Tensor:
    """Project per-head vectors onto the skewed partial channels.

    x: [B, Hx, T, d] queries or keys; skew: [Hkv, d, d] or None (identity);
    channels: [Hkv, c]. Query heads are mapped to their KV head (Hx = Hkv * G).
    Returns [B, Hx, T, c].
    """
    hkv = channels.shape[0]
    group = x.shape[1] // hkv
    if skew is not None:
        a = skew.to(x.dtype).repeat_interleave(group, dim=0)  # [Hx, d, d]
        x = torch.einsum("bhtd,hde->bhte", x, a)
    idx = channels.repeat_interleave(group, dim=0)  # [Hx, c]
    idx = idx[None, :, None, :].expand(x.shape[0], -1, x.shape[2], -1)
    return torch.gather(x, -1, idx)


def partial_projection(skew: torch.Tensor | None, channels: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The columns of the skew that survive the channel choice, [Hkv, d, c]: projecting onto
    them equals skewing then gathering the channels, in one matmul (identity columns when
    there is no skew, which keeps the values exact)."""
    hkv, c = channels.shape
    a = skew if skew is not None else torch.eye(head_dim).expand(hkv, head_dim, head_dim)
    idx = channels[:, None, :].expand(hkv, head_dim, c)
    return torch.gather(a.to(torch.float32), 2, idx).contiguous()


def project_partial(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """x [B, Hx, T, d] (Hx = Hkv * G) onto projection [Hkv, d, c] -> [B, Hx, T, c]."""
    b, hx, t, d = x.shape
    hkv, _, c = projection.shape
    g = hx // hkv
    xs = x.reshape(b, hkv, g * t, d)
    out = torch.matmul(xs, projection.to(x.dtype))  # broadcast over batch: [B, Hkv, G*T, c]
    return out.reshape(b, hx, t, c)


def partial_scores(q_partial: torch.Tensor, k_partial: torch.Tensor, scaling: float) -> torch.Tensor:
    """Approximate attention logits from partial channels.

    q_partial: [B, H, c] (one decode position); k_partial: [B, Hkv, T, c].
    Returns [B, H, T].
    """
    b, h, c = q_partial.shape
    hkv = k_partial.shape[1]
    q = q_partial.reshape(b, hkv, h // hkv, c).to(k_partial.dtype)
    s = torch.einsum("bgjc,bgtc->bgjt", q, k_partial)
    return (s * scaling).reshape(b, h, -1)


def aggregate_group(scores: torch.Tensor, valid: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """Turn a GQA group's query-head scores into one score per KV head.

    scores: [B, H, T]; valid: [B, T] (False for padding). Returns [B, Hkv, T], -inf at padding.
    The threshold rule ``g >= max(g) - alpha`` on the result implements:
      max:   a position is kept if the group's largest score is within alpha of the group's top;
      sum:   the same on the sum of the group's scores (a wider spread: fewer positions pass);
      union: kept if it is within alpha of the top for *any* head of the group — computed as
             g = max_h(s_h - max(s_h)), so max(g) = 0 and g >= -alpha is exactly the union;
      mass:  the log of the group's summed estimated attention probabilities,
             g = log Σ_h softmax(s_h) — the quantity the oracle ranks by, estimated; kept if the
             group's mass at the position is within a factor e^alpha of the largest.
    """
    b, h, t = scores.shape
    s = scores.to(torch.float32).reshape(b, num_kv_heads, h // num_kv_heads, t)
    pad = ~valid[:, None, None, :]
    s = s.masked_fill(pad, -math.inf)
    if how == "max":
        g = s.amax(2)
    elif how == "sum":
        g = s.sum(2)
    elif how == "union":
        top = s.amax(-1, keepdim=True)
        g = (s - top.clamp(min=-1e30)).amax(2)
    elif how == "mass":
        # a row without any real position gives NaN here; the padding mask below overwrites it
        g = torch.logsumexp(torch.log_softmax(s, -1), 2)
    else:
        raise ValueError(f"unknown aggregation {how!r}; use max, sum, union or mass")
    return g.masked_fill(~valid[:, None, :], -math.inf)


def select_positions(
    group_scores: torch.Tensor,
    valid: torch.Tensor,
    alpha: float,
    budget: float = 1.0,
    budget_tokens: int | None = None,
    min_tokens: int = 1,
    available: torch.Tensor | None = None,
) -> Selection:
    """Threshold, cap and floor, per (batch, KV head).

    group_scores: [B, Hkv, T] (-inf at padding); valid: [B, T].
    Keeps the positions with ``g >= max(g) - alpha``; caps the count at
    ``min(ceil(budget * context), budget_tokens)``; raises it to ``min_tokens`` (never past the
    context). Padding positions are never selected. ``available`` [B, Hkv, T] (optional) marks
    the positions that can be fetched at all (a capped host pool evicts some); the context —
    and so the fraction — still counts every real position.
    """
    if available is not None:
        group_scores = group_scores.masked_fill(~available, -math.inf)
    b, hkv, t = group_scores.shape
    context = valid.sum(-1)  # [B]
    ctx = context[:, None].expand(b, hkv)
    if t == 0:
        empty = torch.zeros(b, hkv, 0, dtype=torch.long, device=group_scores.device)
        return Selection(empty, empty.bool(), context)
    eligible = valid[:, None, :].expand(b, hkv, t)
    if available is not None:
        eligible = eligible & available
    top = group_scores.amax(-1, keepdim=True)
    keep = (group_scores >= (top - alpha)) & eligible
    kept = keep.sum(-1)
    count = kept
    cap = torch.ceil(ctx.to(torch.float64) * budget).to(torch.long)
    if budget_tokens is not None:
        cap = cap.clamp(max=budget_tokens)
    count = torch.minimum(count, cap)
    count = torch.maximum(count, torch.clamp(ctx, max=min_tokens))
    count = torch.minimum(count, ctx)
    if available is not None:
        count = torch.minimum(count, (available & valid[:, None, :]).sum(-1))
    n = int(count.max().item()) if count.numel() else 0
    if n == 0:
        empty = torch.zeros(b, hkv, 0, dtype=torch.long, device=group_scores.device)
        return Selection(empty, empty.bool(), context)
    adjust = count != kept  # the cap or the floor moved these rows off the threshold
    if bool(adjust.any()):
        # Rows whose count changed keep their top-`count` scores: threshold at the count-th best.
        k = int(count[adjust].max().item())
        best = torch.topk(group_scores.masked_fill(~eligible, -math.inf), k, dim=-1, sorted=True).values
        kth = best.gather(-1, (count - 1).clamp(min=0, max=k - 1)[..., None])  # used where adjust only
        keep = torch.where(adjust[..., None], (group_scores >= kth) & eligible, keep)
    rank = keep.long().cumsum(-1) - 1
    keep &= rank < count[..., None]  # exact ties at the cut never push a row past its count
    return selection_from_mask(keep, context)


def selection_from_mask(keep: torch.Tensor, context: torch.Tensor) -> Selection:
    """A boolean mask [B, Hkv, T] of chosen positions as a Selection (ascending indices,
    padded to the largest row), without sorting: each kept position goes to its rank."""
    b, hkv, t = keep.shape
    counts = keep.sum(-1)
    n = int(counts.max().item()) if counts.numel() else 0
    rank = keep.long().cumsum(-1) - 1
    target = torch.where(keep, rank, torch.full_like(rank, n))
    out = torch.zeros(b, hkv, n + 1, dtype=torch.long, device=keep.device)
    out.scatter_(-1, target, torch.arange(t, device=keep.device).expand(b, hkv, t))
    slot_valid = torch.arange(n, device=out.device)[None, None, :] < counts[..., None]
    indices = torch.where(slot_valid, out[..., :n], torch.zeros_like(out[..., :n]))
    return Selection(indices, slot_valid, context)


def budget_counts(context: torch.Tensor, budget: float, budget_tokens: int | None = None) -> torch.Tensor:
    """Positions a budgeted policy keeps per batch row: ceil(budget * context), capped by
    `budget_tokens`, at least 1 and never more than the context. context: [B] -> [B]."""
    k = torch.ceil(context.to(torch.float64) * budget).to(torch.long)
    if budget_tokens is not None:
        k = k.clamp(max=budget_tokens)
    return torch.minimum(k.clamp(min=1), context)


def selection_mask(selection: Selection, length: int) -> torch.Tensor:
    """The chosen positions of a Selection as a boolean mask [B, Hkv, length]."""
    b, hkv, _ = selection.indices.shape
    mask = torch.zeros(b, hkv, length + 1, dtype=torch.bool, device=selection.indices.device)
    idx = torch.where(selection.valid, selection.indices, torch.full_like(selection.indices, length))
    mask.scatter_(-1, idx, True)
    return mask[..., :length]


def select_blocks(
    group_scores: torch.Tensor,
    valid: torch.Tensor,
    block: int,
    alpha: float,
    budget: float = 1.0,
    budget_tokens: int | None = None,
    min_tokens: int = 1,
    available: torch.Tensor | None = None,
) -> Selection:
    """The same rule applied to aligned blocks of `block` positions (a block scores its best
    position); every real position of a chosen block is selected.

    A slow tier reads whole blocks anyway (a 4 KiB disk block holds 16 positions of one head in
    fp16 at d = 64), so choosing blocks turns read amplification into attended positions.
    Budget and floor are converted to blocks; padding positions are never selected.
    """
    if block <= 1:
        return select_positions(group_scores, valid, alpha, budget, budget_tokens, min_tokens, available)
    b, hkv, t = group_scores.shape
    nb = -(-t // block)
    pad = nb * block - t
    g = group_scores
    ok = valid[:, None, :].expand(b, hkv, t)
    if available is not None:
        ok = ok & available
    g = g.masked_fill(~ok, -math.inf)
    if pad:
        g = torch.nn.functional.pad(g, (0, pad), value=-math.inf)
        ok = torch.nn.functional.pad(ok, (0, pad), value=False)
    blk_scores = g.view(b, hkv, nb, block).amax(-1)
    blk_ok = ok.view(b, hkv, nb, block).any(-1)
    blk_valid = blk_ok.any(1)  # [B, nb]: blocks holding any real position
    blk_sel = select_positions(
        blk_scores,
        blk_valid,
        alpha,
        budget,
        None if budget_tokens is None else max(1, budget_tokens // block),
        max(1, -(-min_tokens // block)),
        available=blk_ok,
    )
    offs = torch.arange(block, device=g.device)
    idx = (blk_sel.indices[..., None] * block + offs).flatten(-2)  # [B, Hkv, n * block]
    keep = blk_sel.valid[..., None].expand(*blk_sel.valid.shape, block).flatten(-2)
    keep = keep & (idx < t)
    idx = idx.clamp(max=max(t - 1, 0))
    keep = keep & torch.gather(ok, -1, idx)
    return Selection(torch.where(keep, idx, torch.zeros_like(idx)), keep, valid.sum(-1))


def attention_recall(true_probs: torch.Tensor, selection: Selection) -> torch.Tensor:
    """Attention mass captured by a selection, per (batch, query head).

    true_probs: [B, H, T] softmax weights over the cached positions only (the current token
    is excluded, as it is always attended). Returns [B, H] = sum of weights on the selected
    positions / total weight on cached positions.
    """
    b, h, t = true_probs.shape
    hkv = selection.indices.shape[1]
    chosen = torch.zeros(b, hkv, t, dtype=true_probs.dtype, device=true_probs.device)
    chosen.scatter_add_(-1, selection.indices, selection.valid.to(true_probs.dtype))
    chosen = chosen.clamp(max=1).repeat_interleave(h // hkv, dim=1)
    total = true_probs.sum(-1).clamp(min=1e-30)
    return (true_probs * chosen).sum(-1) / total
