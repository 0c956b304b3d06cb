"""Pure tensor math of speculation and selection (no model code).

Shapes: B batch, H query heads, Hkv KV heads (H = Hkv * G for a GQA group of size G),
T cached positions, c partial channels. `valid` [B, Hkv, T] marks the positions of a layer that
exist for each KV head: real tokens (not left padding) still stored (not evicted by a capped
host pool). When every position exists, callers may pass `all_valid(B, Hkv, T)`, an expanded
view of one True that the functions here recognize in O(1) and never mask with. A budget is a
fraction of a row's valid positions.
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


def select_blocks(
    group_scores: torch.Tensor,
    valid: torch.Tensor,
    block: int,
    alpha: float,
    budget: float = 1.0,
    budget_tokens: int | None = None,
    min_tokens: int = 1,
) -> Selection:
    """The same rule applied to aligned blocks of `block` positions (a block scores its best
    position); every valid position of a chosen block is selected.

    A slow tier reads whole blocks anyway (a 4 KiB disk block holds 16 positions of one head in
    fp16 at d = 64), so choosing blocks turns read amplification into attended positions.
    Budget and floor are converted to blocks; positions that are not valid are never selected.
    """
    if block <= 1:
        return select_positions(group_scores, valid, alpha, budget, budget_tokens, min_tokens)
    b, hkv, t = group_scores.shape
    nb = -(-t // block)
    pad = nb * block - t
    g = group_scores.masked_fill(~valid, -math.inf)
    ok = valid
    if pad:
        g = torch.nn.functional.pad(g, (0, pad), value=-math.inf)
        ok = torch.nn.functional.pad(ok, (0, pad), value=False)
    blk_scores = g.reshape(b, hkv, nb, block).amax(-1)
    blk_ok = ok.reshape(b, hkv, nb, block).any(-1)  # [B, Hkv, nb]: blocks holding a valid position
    blk_sel = select_positions(
        blk_scores,
        blk_ok,
        alpha,
        budget,
        None if budget_tokens is None else max(1, budget_tokens // block),
        max(1, -(-min_tokens // block)),
    )
    offs = torch.arange(block, device=g.device)
    idx = (blk_sel.indices[..., None] * block + offs).flatten(-2)  # [B, Hkv, n * block]
    keep = blk_sel.valid[..., None].expand(*blk_sel.valid.shape, block).flatten(-2)
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


# ---------------------------------------------------------------------- budgets across layers
RECALL_GRID = tuple(float(x) for x in torch.logspace(math.log10(0.002), 0.0, 40).tolist())


def oracle_recall_curve(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, scaling: float, grid: torch.Tensor
) -> torch.Tensor:
    """Mean recall of the oracle's selection at each fraction of `grid`, over query positions.

    query [H, T, d], key [Hkv, T, d] (post-RoPE, one sequence); positions: the query positions
    sampled (each attends to the positions before it, as a decode step does). For each, the
    oracle keeps the ceil(f * p) positions with the most group-summed true attention, and its
    recall is the attention mass they hold, averaged over query heads. Returns [len(grid)]."""
    h, _, d = query.shape
    hkv = key.shape[0]
    g = h // hkv
    out = torch.zeros(len(grid), dtype=torch.float64)
    for p in positions.tolist():
        q = query[:, p].to(torch.float32).reshape(hkv, g, 1, d)
        s = torch.matmul(q, key[:, None, :p].to(torch.float32).transpose(-1, -2))[:, :, 0] * scaling  # [Hkv, G, p]
        probs = torch.softmax(s, -1)
        order = probs.sum(1).argsort(-1, descending=True)  # [Hkv, p]
        cum = probs.gather(-1, order[:, None, :].expand(hkv, g, p)).cumsum(-1)  # [Hkv, G, p]
        count = torch.ceil(grid.to(torch.float64) * p).long().clamp(1, p)
        out += cum[..., count - 1].mean((0, 1)).to(torch.float64)
    return (out / max(len(positions), 1)).to(torch.float32)


def allocate_budgets(
    curves: dict[int, torch.Tensor], grid: torch.Tensor, budget: float, floor_share: float = 0.25
) -> dict[int, float]:
    """Per-layer fractions whose mean is `budget`, spread to maximise the summed recall of the
    layers' recall curves (recall at each fraction of `grid`, from calibration).

    Greedy on a fine grid: every layer starts at `floor_share * budget` (no layer is starved by
    a calibration quirk), then steps of the fraction go to the layers whose recall gains most
    per step. The curves are made concave (marginal gains non-increasing) first, so taking the
    largest marginal gains overall is the exact greedy optimum for those curves."""
    layers = sorted(curves)
    if not layers or budget >= 1.0:
        return {i: min(budget, 1.0) for i in layers}
    low = budget * floor_share
    steps = 400
    fine = torch.linspace(low, 1.0, steps + 1, dtype=torch.float64)
    step = (1.0 - low) / steps
    take = round(len(layers) * (budget - low) / step)
    if take <= 0:
        return {i: low for i in layers}
    per_layer = _greedy_steps([curves[i] for i in layers], grid, fine, take).to(torch.float64)
    fractions = (low + per_layer * step).clamp(max=1.0)
    fractions = fractions * (budget * len(layers) / fractions.sum())  # exact mean after rounding
    return {i: float(min(f, 1.0)) for i, f in zip(layers, fractions.tolist())}


# ---------------------------------------------------------------------- per-layer channel counts
CHANNEL_EIGHTHS = (1, 2, 3, 4, 5, 6, 8)  # channel counts measured at calibration, in eighths of d
CHANNEL_RECALL_FRACTIONS = (0.05, 0.1, 0.2)  # fetched fractions the partial recall is averaged over


def channel_grid(head_dim: int) -> list[int]:
    """The channel counts whose partial recall calibration measures (ascending, distinct)."""
    return sorted({max(1, min(head_dim, round(e * head_dim / 8))) for e in CHANNEL_EIGHTHS})


def partial_recall_table(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    skew: torch.Tensor | None,
    order: torch.Tensor,
    counts: list[int],
    fractions: tuple[float, ...] = CHANNEL_RECALL_FRACTIONS,
) -> torch.Tensor:
    """Recall of speculating with the top-c skewed channels, for each c of `counts`.

    query [H, T, d], key [Hkv, T, d] (post-RoPE, one sequence); skew [Hkv, d, d] (None: identity);
    order [Hkv, d]: the skewed channels ranked (`skew_from_qk`), of which the first c are kept.
    At each sampled query position p (attending to the p positions before it, as a decode step
    does), each KV head keeps the ceil(f * p) positions of largest `mass`-aggregated partial
    score, and the recall is the true attention mass they hold, averaged over the query heads,
    the positions and the fractions f of `fractions`. Returns [len(counts)] (float32)."""
    h, t, d = query.shape
    hkv = key.shape[0]
    g = h // hkv
    a = skew.to(torch.float32) if skew is not None else torch.eye(d).expand(hkv, d, d)
    cols = torch.gather(a, 2, order[:, None, :].expand(hkv, d, d))  # skew columns in rank order
    qa = torch.matmul(query.to(torch.float32).reshape(hkv, g * t, d), cols).reshape(hkv, g, t, d)
    ka = torch.matmul(key.to(torch.float32), cols)  # [Hkv, T, d]
    frac = torch.tensor(fractions, dtype=torch.float64)
    out = torch.zeros(len(counts), dtype=torch.float64)
    for p in positions.tolist():
        q = query[:, p].to(torch.float32).reshape(hkv, g, 1, d)
        s = torch.matmul(q, key[:, None, :p].to(torch.float32).transpose(-1, -2))[:, :, 0] * scaling  # [Hkv, G, p]
        probs = torch.softmax(s, -1)
        keep = torch.ceil(frac * p).long().clamp(1, p)
        partial = torch.zeros(hkv, g, p)
        low = 0
        for j, c in enumerate(counts):  # partial scores grow by the channels [low, c)
            partial += torch.matmul(qa[:, :, p, low:c], ka[:, :p, low:c].transpose(-1, -2))
            low = c
            ranked = torch.logsumexp(torch.log_softmax(partial * scaling, -1), 1).argsort(-1, descending=True)
            cum = probs.gather(-1, ranked[:, None, :].expand(hkv, g, p)).cumsum(-1)
            out[j] += cum[..., keep - 1].mean().to(torch.float64)
    return (out / max(len(positions), 1)).to(torch.float32)


def allocate_channels(
    tables: dict[int, torch.Tensor], counts: list[int] | torch.Tensor, ratio: float, head_dim: int
) -> dict[int, int]:
    """Per-layer channel counts whose mean is `ratio * head_dim` (or the nearest below that
    integer counts allow), each in [head_dim / 8, head_dim], spread to maximise the summed
    partial recall of the layers' tables (recall at each count of `counts`, from calibration).

    The same greedy as `allocate_budgets`, one channel per step: every layer starts at the
    floor, each table is interpolated to every integer count and made concave, and the
    largest marginal gains overall are taken."""
    layers = sorted(tables)
    cap = head_dim
    total = math.floor(len(layers) * ratio * head_dim + 1e-9)
    floor = max(1, min(head_dim // 8, total // max(len(layers), 1)))
    if not layers or total >= len(layers) * cap:
        return {i: cap for i in layers}
    fine = torch.arange(floor, cap + 1, dtype=torch.float64)
    take = total - len(layers) * floor
    extra = _greedy_steps([tables[i] for i in layers], torch.as_tensor(counts), fine, take)
    return {i: int(floor + e) for i, e in zip(layers, extra.tolist())}


def _greedy_steps(curves: list[torch.Tensor], xp: torch.Tensor, fine: torch.Tensor, take: int) -> torch.Tensor:
    """How many of `take` steps along `fine` each curve gets (curve j: values at `xp`, ascending)
    to maximise the summed values: each curve is interpolated to `fine` and made concave
    (marginal gains never increase), so taking the largest gains overall is the exact greedy
    optimum. Returns [len(curves)] step counts (long)."""
    xp = xp.to(torch.float64)
    gains = []
    for curve in curves:
        r = _interp(fine, xp, curve.to(torch.float64)) if len(xp) > 1 else fine * 0
        gains.append(torch.cummin(r.diff(), 0).values)  # concave envelope from below
    flat = torch.stack(gains).T.flatten()  # step-major: equal gains (a straight piece) alternate curves
    chosen = torch.argsort(flat, descending=True, stable=True)[:take]
    return torch.bincount(chosen % len(curves), minlength=len(curves))


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation of (xp, fp) at x (xp ascending; clamped at the ends)."""
    idx = torch.searchsorted(xp, x).clamp(1, len(xp) - 1)
    x0, x1, y0, y1 = xp[idx - 1], xp[idx], fp[idx - 1], fp[idx]
    w = ((x - x0) / (x1 - x0)).clamp(0, 1)
    return y0 + w * (y1 - y0)


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


# ---------------------------------------------------------------------- the correction, calibrated
CORRECTION_BUDGETS = (0.025, 0.05, 0.1, 0.2)  # fetched fractions the correction table is measured at
CORRECTION_SHARES = (0.0, 0.125, 0.25, 0.5)  # shares of a layer's budget fetched as the top-up
# A layer's speculation is corrected only where its attention output strays more than a target
# multiple of the oracle's at the same budget: below it the top-up's second, unoverlapped transfer
# costs more time than the little it could add. The targets tried, least correction first: the
# project's quality bound (within 1.5x of the oracle's loss) read per layer, then stricter ones.
# The per-layer error does not predict the end loss on every model (on Gemma-3-270m it understates
# it), so the target is chosen per model by the end loss on held-out text (`infinigen.spread`):
# the first whose KL from dense is within KL_AIM times the oracle's (the project's aim).
CORRECTION_TARGETS = (1.5, 1.25, 1.1)
CORRECTION_ERROR_RATIO = CORRECTION_TARGETS[0]
KL_AIM = 1.2


def correction_error_table(
    query: torch.Tensor,
    speculated: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    projection: torch.Tensor,
    budgets: tuple[float, ...] = CORRECTION_BUDGETS,
    shares: tuple[float, ...] = CORRECTION_SHARES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output's error under speculate-then-correct at each (budget b, share s),
    and under the oracle at each b.

    Speculate-then-correct: the speculated query picks ceil(b·(1 - s)·p) positions, then the
    layer's own query tops them up with its ceil(b·s·p) best others, both scored on the partial
    channels and `mass`-aggregated, as at decode (share 0 is plain speculation). The oracle
    keeps the ceil(b·p) positions of most group-summed true attention. Either way the step
    attends its selection and itself, and the error is the squared distance of that output
    from the dense output, averaged over query heads and positions. The output's error, not the
    recall: what a selection misses matters by how far the missed values are from the ones it
    holds, and the speculation's misses cost more than the oracle's diffuse tail at equal recall
    (measured: 1.2x the oracle's missed mass, but 2-3.6x its perplexity loss, on Gemma-3).

    query [H, T, d]: the layer's own queries; speculated [H, P, d]: the speculated queries at the
    P `positions` (from the previous layer's input); key, value [Hkv, T, d] (post-RoPE keys,
    one sequence); projection [Hkv, d, c]: the layer's partial projection
    (`partial_projection`). Returns ([len(budgets), len(shares)], [len(budgets)]) (float32)."""
    h, _, d = query.shape
    hkv = key.shape[0]
    g = h // hkv
    proj = projection.to(torch.float32)
    key_part = torch.matmul(key.to(torch.float32), proj)  # [Hkv, T, c]
    errors = torch.zeros(len(budgets), len(shares), dtype=torch.float64)
    oracle = torch.zeros(len(budgets), dtype=torch.float64)
    for j, p in enumerate(positions.tolist()):
        own = query[:, p].to(torch.float32).reshape(hkv, g, d)
        k, v = key[:, : p + 1].to(torch.float32), value[:, : p + 1].to(torch.float32)
        probs = torch.softmax(torch.bmm(own, k.transpose(1, 2)) * scaling, -1)  # [Hkv, G, p + 1]
        dense = torch.bmm(probs, v)  # [Hkv, G, d]
        ranks = []
        for q in (own, speculated[:, j].to(torch.float32).reshape(hkv, g, d)):
            s = torch.bmm(torch.bmm(q, proj), key_part[:, :p].transpose(1, 2))  # [Hkv, G, p]
            ranks.append(
                torch.logsumexp(torch.log_softmax(s * scaling, -1), 1).argsort(dim=-1, descending=True, stable=True)
            )
        own_rank, spec_rank = ranks
        true_rank = probs[..., :p].sum(1).argsort(dim=-1, descending=True, stable=True)
        masks = []  # per budget: the oracle's, then one per share
        for b in budgets:
            best = torch.zeros(hkv, p, dtype=torch.bool)
            best.scatter_(1, true_rank[:, : min(p, math.ceil(b * p))], True)
            masks.append(best)
            for share in shares:
                chosen = torch.zeros(hkv, p, dtype=torch.bool)
                chosen.scatter_(1, spec_rank[:, : min(p, math.ceil(b * (1 - share) * p))], True)
                free = ~chosen.gather(1, own_rank)
                take = free & (free.long().cumsum(1) <= math.ceil(b * share * p))
                chosen.scatter_(1, own_rank, take | ~free)
                masks.append(chosen)
        keep = torch.cat(
            [torch.stack(masks, 1), torch.ones(hkv, len(masks), 1, dtype=torch.bool)], -1
        )  # itself attended
        kept = (probs[:, None] * keep[:, :, None]).reshape(hkv, -1, p + 1)  # [Hkv, M·G, p + 1]: one product per KV head
        out = torch.bmm(kept, v) / kept.sum(-1, keepdim=True)
        diff = out.view(hkv, len(masks), g, d) - dense[:, None]
        err = diff.pow(2).sum(-1).mean((0, 2)).to(torch.float64).view(len(budgets), 1 + len(shares))
        oracle += err[:, 0]
        errors += err[:, 1:]
    n = max(len(positions), 1)
    return (errors / n).to(torch.float32), (oracle / n).to(torch.float32)


def correction_share(
    errors: torch.Tensor,
    oracle: torch.Tensor,
    budget: float,
    budgets: tuple[float, ...] = CORRECTION_BUDGETS,
    shares: tuple[float, ...] = CORRECTION_SHARES,
    error_ratio: float = CORRECTION_ERROR_RATIO,
) -> float:
    """The share of a layer's `budget` to fetch as the correction's top-up: 0 where plain
    speculation's output error is at most `error_ratio` times the oracle's at that budget, else
    the smallest share that brings it there (each top-up is a second transfer that is not
    overlapped, so no more is fetched than the target asks), else the share of least error. errors [len(budgets), len(shares)],
    oracle [len(budgets)]: `correction_error_table`'s, read at `budget` by interpolating in log
    budget (clamped to the measured range)."""
    if budget >= 1.0:
        return 0.0
    at = torch.tensor([math.log(budget)], dtype=torch.float64)
    xp = torch.tensor(budgets, dtype=torch.float64).log()
    floor = float(_interp(at, xp, oracle.to(torch.float64))[0])
    err = [float(_interp(at, xp, errors[:, z].to(torch.float64))[0]) for z in range(len(shares))]
    within = [z for z in range(len(shares)) if err[z] <= error_ratio * floor]
    best = within[0] if within else min(range(len(shares)), key=lambda z: (err[z], z))
    return float(shares[best])
