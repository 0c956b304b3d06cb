"""The tables calibration measures once per model, and the rules that read them.

Offline, over captured post-RoPE queries and keys of one sequence: the oracle's recall at each
fetched fraction (`oracle_recall_curve`, read by `allocate_budgets` to spread a budget over the
layers), the recall of speculating with c partial channels (`partial_recall_table`, read by
`allocate_channels`), and the attention output's error under speculate-then-correct
(`correction_error_table`, read by `correction_share`). The skew artifact stores the tables; a
selector reads them when it is made. The decode-time rule they serve is `infinigen.speculate`.
"""

from __future__ import annotations

import math

import torch

from infinigen.skew.choice import CORRECTION_TARGETS
from infinigen.speculate import channel_count

# The inputs a speculated query is formed from that calibration measures the correction tables with.
SPECULATED_INPUTS = ("previous", "fitted")

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
    return sorted({channel_count(e / 8, head_dim) for e in CHANNEL_EIGHTHS})


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


# ---------------------------------------------------------------------- the correction, calibrated
CORRECTION_BUDGETS = (0.025, 0.05, 0.1, 0.2)  # fetched fractions the correction table is measured at
CORRECTION_SHARES = (0.0, 0.125, 0.25, 0.5)  # shares of a layer's budget fetched as the top-up


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
    holds, and the speculation's misses can cost more than the oracle's diffuse tail at equal
    recall (docs/results.md).

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
    error_ratio: float = CORRECTION_TARGETS[0],
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
