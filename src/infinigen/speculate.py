"""Pure tensor math of speculation and selection (no model code).

Shapes: B batch, H query heads, Hkv KV heads (H = Hkv * G for a GQA group of size G),
T cached positions, c partial channels. `valid` [B, Hkv, T] marks the positions of a layer that
exist for each KV head: real tokens (not left padding) still stored (not evicted by a capped
host pool). When every position exists, callers may pass `all_valid(B, Hkv, T)`, an expanded
view of one True that the functions here recognize in O(1) and never mask with. A budget is a
fraction of a row's valid positions.

This is the rule a decode step runs; the tables calibration measures offline to set its
per-layer budgets, channel counts and corrections are `infinigen.skew.tables`.
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
    """

    indices: torch.Tensor
    valid: torch.Tensor

    @property
    def counts(self) -> torch.Tensor:
        return self.valid.sum(-1)


def all_valid(batch: int, kv_heads: int, length: int, device=None) -> torch.Tensor:
    """[B, Hkv, T] of True without memory: every position exists (no padding, nothing evicted)."""
    return torch.ones((), dtype=torch.bool, device=device).expand(batch, kv_heads, length)


def is_all_valid(valid: torch.Tensor) -> bool:
    """Whether `valid` is an `all_valid` view (checked from its strides: O(1), no pass over it)."""
    return valid.dim() > 0 and all(st == 0 for st in valid.stride()) and bool(valid.reshape(-1)[0])


def channel_count(ratio: float, head_dim: int) -> int:
    """The partial channels a fraction `ratio` of the head dimension keeps: round(r·d), at least
    one, at most d (what calibration chooses and what the partial keys hold)."""
    return max(1, min(head_dim, round(ratio * head_dim)))


def partial_projection(skew: torch.Tensor | None, channels: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The columns of the skew that survive the channel choice, [Hkv, d, c]: projecting onto
    them equals skewing then gathering the channels, in one matmul (identity columns when
    there is no skew, which keeps the values exact)."""
    hkv, c = channels.shape
    a = skew if skew is not None else torch.eye(head_dim).expand(hkv, head_dim, head_dim)
    idx = channels[:, None, :].expand(hkv, head_dim, c)
    return torch.gather(a.to(torch.float32), 2, idx).contiguous()


def project_partial(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """x [B, Hx, T, d] (Hx = Hkv * G) onto projection [Hkv, d, c] -> [B, Hx, T, c], in float32
    (16-bit keys are projected exactly as float32 ones; the caller stores the result as it likes)."""
    b, hx, t, d = x.shape
    hkv, _, c = projection.shape
    g = hx // hkv
    xs = x.reshape(b, hkv, g * t, d).to(torch.float32)
    out = torch.matmul(xs, projection.to(torch.float32))  # broadcast over batch: [B, Hkv, G*T, c]
    return out.reshape(b, hx, t, c)


def partial_scores(q_partial: torch.Tensor, k_partial: torch.Tensor, scaling: float) -> torch.Tensor:
    """Approximate attention logits from partial channels.

    q_partial: [B, H, c] (one decode position); k_partial: [B, Hkv, T, c] — ideally a transposed
    view of a [B, Hkv, c, T] buffer, which the matmul then streams contiguously.
    Returns [B, H, T].
    """
    b, h, c = q_partial.shape
    hkv = k_partial.shape[1]
    dtype = torch.promote_types(q_partial.dtype, k_partial.dtype)  # 16-bit keys score in float32 on CPU
    q = (q_partial.to(dtype) * scaling).reshape(b, hkv, h // hkv, c)
    return torch.matmul(q, k_partial.transpose(-1, -2).to(dtype)).reshape(b, h, -1)


def aggregate_group(scores: torch.Tensor, valid: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """Turn a GQA group's query-head scores into one score per KV head.

    scores: [B, H, T]; valid: [B, Hkv, T]. Returns [B, Hkv, T], -inf where not valid.
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
    if is_all_valid(valid):
        if how == "max":
            return s.amax(2)
        if how == "union":
            return (s - s.amax(-1, keepdim=True)).amax(2)
    s = s.masked_fill(~valid[:, :, None, :], -math.inf)
    if how == "max":
        return s.amax(2)  # -inf where not valid already
    if how == "union":
        top = s.amax(-1, keepdim=True)
        return (s - top.clamp(min=-1e30)).amax(2)  # -inf - top is -inf where not valid
    if how == "sum":
        g = s.sum(2)
    elif how == "mass":
        # a row without any real position gives NaN here; the padding mask below overwrites it
        g = torch.logsumexp(torch.log_softmax(s, -1), 2)
    else:
        raise ValueError(f"unknown aggregation {how!r}; use max, sum, union or mass")
    return g.masked_fill(~valid, -math.inf)


def select_positions(
    group_scores: torch.Tensor,
    valid: torch.Tensor,
    alpha: float,
    budget: float = 1.0,
    budget_tokens: int | None = None,
    min_tokens: int = 1,
) -> Selection:
    """Threshold, cap and floor, per (batch, KV head).

    group_scores: [B, Hkv, T] (-inf where not valid); valid: [B, Hkv, T].
    Keeps the positions with ``g >= max(g) - alpha``; caps the count at
    ``min(ceil(budget * context), budget_tokens)``, the context being the row's valid
    positions; raises it to ``min_tokens`` (never past the context). Positions that are not
    valid are never selected.
    """
    b, hkv, t = group_scores.shape
    if t == 0:
        empty = torch.zeros(b, hkv, 0, dtype=torch.long, device=group_scores.device)
        return Selection(empty, empty.bool())
    top = group_scores.amax(-1, keepdim=True)
    keep = group_scores >= (top - alpha)
    if is_all_valid(valid):  # every row's context is t: the cap and the floor are numbers
        kept = keep.sum(-1)
        cap = math.ceil(t * budget) if budget < 1 else t
        if budget_tokens is not None:
            cap = min(cap, budget_tokens)
        count = kept.clamp(max=cap).clamp(min=min(t, min_tokens))
    else:
        keep &= valid
        kept = keep.sum(-1)
        ctx = valid.sum(-1)  # [B, Hkv]
        cap = torch.ceil(ctx.to(torch.float64) * budget).to(torch.long)
        if budget_tokens is not None:
            cap = cap.clamp(max=budget_tokens)
        count = torch.minimum(kept, cap)
        count = torch.maximum(count, torch.clamp(ctx, max=min_tokens))
        count = torch.minimum(count, ctx)
    n = int(count.max().item()) if count.numel() else 0
    if n == 0:
        empty = torch.zeros(b, hkv, 0, dtype=torch.long, device=group_scores.device)
        return Selection(empty, empty.bool())
    adjust = count != kept  # the cap or the floor moved these rows off the threshold
    if bool(adjust.any()):
        # Rows whose count changed keep their top-`count` scores instead.
        ranked = group_scores if is_all_valid(valid) else group_scores.masked_fill(~valid, -math.inf)
        cut = best_count(ranked, valid, torch.where(adjust, count, 0))
        keep = torch.where(adjust[..., None], cut, keep)
    return selection_from_mask(keep, count)


def best_count(ranked: torch.Tensor, allowed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The mask [B, Hkv, T] of each row's `count` [B, Hkv] best `ranked` scores among the positions
    `allowed` (where `ranked` is -inf elsewhere; count <= the allowed positions). Everything
    above the count-th best is kept, and exact ties at it fill the rest of the count earliest
    first, so a tie never pushes a row past its count nor crowds out a higher score (the
    selection kernel applies the same rule)."""
    k = int(count.max().item()) if count.numel() else 0
    if k == 0:
        return torch.zeros_like(allowed)
    best = torch.topk(ranked, k, dim=-1, sorted=True).values
    kth = best.gather(-1, (count - 1).clamp(min=0, max=k - 1)[..., None])
    above = (ranked > kth) & allowed
    ties = (ranked == kth) & allowed
    room = count - above.sum(-1)
    return (above | (ties & (ties.long().cumsum(-1) <= room[..., None]))) & (count > 0)[..., None]


def selection_from_mask(keep: torch.Tensor, counts: torch.Tensor | None = None) -> Selection:
    """A boolean mask [B, Hkv, T] of chosen positions as a Selection (ascending indices,
    padded to the largest row). `counts` [B, Hkv]: the mask's per-row sums, if known.

    `nonzero` lists the chosen (b, h, t) in row-major order, so each row's positions arrive
    ascending; a position's slot is its index in that list minus where its row starts."""
    b, hkv, t = keep.shape
    if counts is None:
        counts = keep.sum(-1)
    n = int(counts.max().item()) if counts.numel() else 0
    indices = torch.zeros(b, hkv, n, dtype=torch.long, device=keep.device)
    slot_valid = torch.arange(n, device=keep.device)[None, None, :] < counts[..., None]
    if n:
        nz = keep.nonzero()  # [m, 3]
        row = nz[:, 0] * hkv + nz[:, 1]
        starts = counts.flatten().cumsum(0) - counts.flatten()
        slot = torch.arange(nz.shape[0], device=keep.device) - starts[row]
        indices[nz[:, 0], nz[:, 1], slot] = nz[:, 2]
    return Selection(indices, slot_valid)


def budget_counts(context: torch.Tensor, budget: float, budget_tokens: int | None = None) -> torch.Tensor:
    """Positions a budgeted policy keeps per row: ceil(budget * context), capped by
    `budget_tokens`, at least 1 and never more than the context (elementwise, any shape)."""
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


UNIT_SCORES = ("max", "mass", "top2")  # how a unit of positions is scored from its positions' scores
UNIT_HEADS = ("own", "shared")  # each KV head chooses its units, or one choice for a token's heads


def unit_scores(
    group_scores: torch.Tensor, valid: torch.Tensor, block: int, rule: str = "max", shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each aligned unit of `block` positions scored from its valid positions' scores, and
    whether it holds one: ([B, Hkv, nb], [B, Hkv, nb]), or [B, 1, nb] each when `shared`.

    max:  its best position (a unit is worth reading if one row in it is);
    mass: the log of its summed estimated attention, logsumexp (what attending it captures);
    top2: the mean of its two best positions (one outlier does not carry a unit).
    shared: one score per token range over every KV head's positions; the scores are turned
    into log-probabilities per head first, so that no head's scale dominates.
    """
    b, hkv, t = group_scores.shape
    nb = -(-t // block)
    pad = nb * block - t
    g = group_scores.to(torch.float32).masked_fill(~valid, -math.inf)
    ok = valid
    if shared:
        g = torch.log_softmax(g, -1).nan_to_num(nan=-math.inf)  # a row without a valid position stays -inf
    if pad:
        g = torch.nn.functional.pad(g, (0, pad), value=-math.inf)
        ok = torch.nn.functional.pad(ok, (0, pad), value=False)
    g = g.reshape(b, hkv, nb, block)
    ok = ok.reshape(b, hkv, nb, block)
    if shared:  # [B, 1, nb, Hkv * block]: a unit holds every head's rows of its positions
        g = g.permute(0, 2, 1, 3).reshape(b, 1, nb, hkv * block)
        ok = ok.permute(0, 2, 1, 3).reshape(b, 1, nb, hkv * block)
    unit_ok = ok.any(-1)
    if rule == "max":
        score = g.amax(-1)
    elif rule == "mass":
        score = torch.logsumexp(g, -1)
    elif rule == "top2":
        if g.shape[-1] < 2:
            score = g.amax(-1)
        else:
            two = torch.topk(g, 2, dim=-1).values
            second = torch.where(torch.isfinite(two[..., 1]), two[..., 1], two[..., 0])  # one valid row: itself
            score = (two[..., 0] + second) / 2
    else:
        raise ValueError(f"unknown unit score {rule!r}; use one of {', '.join(UNIT_SCORES)}")
    return score.masked_fill(~unit_ok, -math.inf), unit_ok


def select_blocks(
    group_scores: torch.Tensor,
    valid: torch.Tensor,
    block: int,
    alpha: float,
    budget: float = 1.0,
    budget_tokens: int | None = None,
    min_tokens: int = 1,
    rule: str = "max",
    shared: bool = False,
) -> Selection:
    """The same rule applied to aligned units of `block` positions, each scored by `rule`
    (`unit_scores`); every valid position of a chosen unit is selected. With `shared`, one
    choice of units serves every KV head (a token's heads read together).

    A slow tier reads whole blocks anyway (a 4 KiB disk block holds 16 positions of one head in
    fp16 at d = 64), so choosing blocks turns read amplification into attended positions.
    Budget and floor are converted to units; positions that are not valid are never selected.
    """
    if block <= 1 and not shared:
        return select_positions(group_scores, valid, alpha, budget, budget_tokens, min_tokens)
    blk_scores, blk_ok = unit_scores(group_scores, valid, block, rule, shared)
    return select_units(blk_scores, blk_ok, valid, block, alpha, budget, budget_tokens, min_tokens)


def in_units(budget_tokens: int | None, min_tokens: int, block: int) -> tuple[int | None, int]:
    """The cap and the floor, given in positions, as whole units of `block`: the cap rounded
    down, the floor up, each at least one unit (the selection kernel's rule too)."""
    return (None if budget_tokens is None else max(1, budget_tokens // block)), max(1, -(-min_tokens // block))


def select_units(
    scores: torch.Tensor,
    unit_ok: torch.Tensor,
    valid: torch.Tensor,
    block: int,
    alpha: float,
    budget: float = 1.0,
    budget_tokens: int | None = None,
    min_tokens: int = 1,
) -> Selection:
    """The rule over units already scored ([B, Hkv or 1, units], -inf where `unit_ok` is False),
    budget and floor converted to units; every valid position (`valid` [B, Hkv, T]) of a chosen
    unit is selected, for every KV head when the units are shared."""
    blk_sel = select_positions(scores, unit_ok, alpha, budget, *in_units(budget_tokens, min_tokens, block))
    return expand_units(blk_sel.indices, blk_sel.valid, valid, block)


def expand_units(units: torch.Tensor, chosen: torch.Tensor, valid: torch.Tensor, block: int) -> Selection:
    """Every valid position (`valid` [B, Hkv, T]) of the units `units` [B, Hkv or 1, n] where
    `chosen`: a Selection of n * block slots per row, ascending where the units are, slots that
    fall past T or on a position that is not valid marked not valid (the layers skip them)."""
    b, hkv, t = valid.shape
    n = units.shape[-1]
    offs = torch.arange(block, device=units.device)
    idx = (units[..., None] * block + offs).flatten(-2).expand(b, hkv, n * block)
    keep = chosen[..., None].expand(*chosen.shape, block).flatten(-2).expand(b, hkv, -1)
    keep = keep & (idx < t)
    idx = idx.clamp(max=max(t - 1, 0))
    keep = keep & torch.gather(valid, -1, idx)
    return Selection(torch.where(keep, idx, torch.zeros_like(idx)), keep)


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


def group_sum(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, ...] summed over each GQA group -> [B, Hkv, ...]."""
    b, h = x.shape[:2]
    return x.reshape(b, kv_heads, h // kv_heads, *x.shape[2:]).sum(2)


def attention_column_sums(
    query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor, scaling: float, chunk: int = 256
) -> torch.Tensor:
    """Causal attention weights of a prefill, summed over its real queries and each GQA
    group's heads: query [B, H, Q, d] (the last Q of the K positions), key [B, Hkv, K, d],
    valid [B, K] -> [B, Hkv, K]. Chunked over queries to bound memory; each chunk scores only
    the keys its rows can see (causal), and a group's heads share their key matrix (no copy),
    which makes H2O's prefill pass about half the work of a full-width one."""
    b, h, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    g = h // hkv
    offset = k_len - q_len
    k = key.to(torch.float32)
    out = torch.zeros(b, hkv, k_len, dtype=torch.float32, device=query.device)
    cols = torch.arange(k_len, device=query.device)
    for r0 in range(0, q_len, chunk):
        r1 = min(q_len, r0 + chunk)
        n, end = r1 - r0, offset + r1  # rows in the chunk; keys any of them can see
        q = query[:, :, r0:r1].to(torch.float32).reshape(b, hkv, g * n, d)
        s = torch.matmul(q, k[:, :, :end].transpose(-1, -2)).mul_(scaling).view(b, hkv, g, n, end)
        rows = torch.arange(offset + r0, end, device=query.device)
        allowed = (cols[None, :end] <= rows[:, None])[None] & valid[:, None, :end]  # [B, n, end]
        probs = torch.softmax(s.masked_fill_(~allowed[:, None, None], -math.inf), -1)
        # a real row always sees itself; a padded row (possibly all masked, NaN) counts nothing
        probs.masked_fill_(~valid[:, offset + r0 : end][:, None, None, :, None], 0.0)
        out[..., :end] += probs.sum((2, 3))
    return out


class PrefillAttention:
    """The attention of a prefill, computed only if a selector asks for it (H2O accumulates its
    column sums; the others never pay for them)."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor, scaling: float) -> None:
        self._args = (query, key, valid, scaling)
        self._sums: torch.Tensor | None = None

    def column_sums(self) -> torch.Tensor:
        """[B, Hkv, K]: the prefill's attention weights summed over its real queries and each group."""
        if self._sums is None:
            self._sums = attention_column_sums(*self._args)
        return self._sums


# ---------------------------------------------------------------------- speculate, then correct
def top_up(group_scores: torch.Tensor, valid: torch.Tensor, chosen: torch.Tensor, count: torch.Tensor) -> Selection:
    """The `count` [B, Hkv] best-scoring valid positions that `chosen` [B, Hkv, T] does not hold:
    what a correction adds to a speculated selection once the layer's own query has scored the
    partial keys. group_scores [B, Hkv, T] (-inf where not valid)."""
    b, hkv, t = group_scores.shape
    open_ = valid & ~chosen
    count = torch.minimum(count, open_.sum(-1))
    k = int(count.max().item()) if count.numel() else 0
    if k == 0 or t == 0:
        empty = torch.zeros(b, hkv, 0, dtype=torch.long, device=group_scores.device)
        return Selection(empty, empty.bool())
    return selection_from_mask(best_count(group_scores.masked_fill(~open_, -math.inf), open_, count), count)
