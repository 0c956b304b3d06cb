"""Each baseline's selection against a brute-force reference written with plain loops."""

import math
from types import SimpleNamespace

import pytest
import torch

from infinigen.select.base import UnitSelection
from infinigen.select.h2o import H2OKnobs, H2OSelector
from infinigen.select.oracle import OracleSelector
from infinigen.select.quest import QuestKnobs, QuestSelector
from infinigen.select.streaming import StreamingKnobs, StreamingSelector
from infinigen.speculate import (
    aggregate_group,
    attention_recall,
    budget_counts,
    select_positions,
    selection_mask,
)

B, H, HKV, D = 2, 4, 2, 8


def adapter():
    return SimpleNamespace(num_kv_heads=HKV, scaling=lambda i: D**-0.5)


def padded_valid(t: int, pad: int = 3) -> torch.Tensor:
    valid = torch.ones(B, t, dtype=torch.bool)
    valid[1, :pad] = False
    return valid


def heads(valid: torch.Tensor) -> torch.Tensor:
    """[B, T] token validity as the [B, Hkv, T] a selector takes."""
    return valid[:, None, :].expand(B, HKV, valid.shape[1])


class Weights:
    """Given prefill attention column sums, as a selector's `on_prefill` receives them."""

    def __init__(self, sums):
        self.sums = sums

    def column_sums(self):
        return self.sums


def as_sets(sel) -> list[list[set]]:
    return [
        [{int(p) for p, ok in zip(sel.indices[b, h], sel.valid[b, h], strict=True) if ok} for h in range(HKV)]
        for b in range(B)
    ]


def count(ctx: int, budget: float) -> int:
    return min(max(math.ceil(ctx * budget), 1), ctx)


def test_budget_counts():
    got = budget_counts(torch.tensor([0, 1, 10, 100]), 0.25, budget_tokens=20)
    assert got.tolist() == [0, 1, 3, 20]


@pytest.mark.parametrize("budget,sinks", [(0.3, 2), (0.1, 4), (1.0, 4), (0.05, 0)])
def test_streaming_keeps_first_real_positions_and_the_most_recent(budget, sinks):
    t = 40
    valid = padded_valid(t)
    pol = StreamingSelector(StreamingKnobs(budget=budget, sinks=sinks), adapter())
    sel = pol.select(None, 2, None, t, heads(valid))
    for b in range(B):
        real = [p for p in range(t) if valid[b, p]]
        k = count(len(real), budget)
        n_sink = min(sinks, k)
        want = set(real[:n_sink]) | set(real[len(real) - (k - n_sink) :])
        assert all(s == want for s in as_sets(sel)[b])


def _h2o_reference(acc0, kept0, steps, budget, recent_ratio, valid):
    """Plain-loop H2O: keep the recent share, then the largest accumulated scores."""
    acc = [[list(map(float, acc0[b, h])) for h in range(HKV)] for b in range(B)]
    kept = [[{p for p in range(len(acc0[b, h])) if kept0[b, h, p]} for h in range(HKV)] for b in range(B)]
    history = []
    for probs, self_probs in steps:
        t = len(acc[0][0])
        chosen = []
        for b in range(B):
            ctx = int(valid[b, :t].sum())
            k = count(ctx, budget)
            n_recent = math.floor(k * recent_ratio)
            row = []
            for h in range(HKV):
                cand = sorted(kept[b][h])
                recent = set(cand[::-1][:n_recent])
                rest = sorted((p for p in cand if p not in recent), key=lambda p: (-acc[b][h][p], p))
                keep = recent | set(rest[: k - len(recent)])
                kept[b][h] = keep
                row.append(keep)
            chosen.append(row)
        history.append([[set(s) for s in row] for row in chosen])
        # observe: the group's weights on the kept positions, then the new token joins
        for b in range(B):
            for h in range(HKV):
                for p in chosen[b][h]:
                    acc[b][h][p] += float(probs[b, h, p])
                acc[b][h].append(float(self_probs[b, h]))
                kept[b][h].add(t)
    return history


def test_h2o_matches_a_plain_loop_over_steps():
    torch.manual_seed(0)
    t0, steps, budget = 30, 6, 0.3
    valid = padded_valid(t0 + steps)
    pol = H2OSelector(H2OKnobs(budget=budget, recent_ratio=0.5), adapter())
    state = pol.new_state(2)
    pol.on_append(state, 2, torch.randn(B, HKV, t0, D), valid[:, :t0])
    colsum = torch.rand(B, HKV, t0) * valid[:, None, :t0]
    pol.on_prefill(state, 2, Weights(colsum))
    acc0, kept0 = state.acc.clone(), state.kept.clone()
    # random per-step attention weights, defined on every position (group sums per KV head)
    obs = [(torch.rand(B, HKV, t0 + s), torch.rand(B, HKV)) for s in range(steps)]
    got = []
    for s in range(steps):
        t = t0 + s
        sel = pol.select(state, 2, None, t, heads(valid[:, :t]))
        got.append(as_sets(sel))
        pol.on_append(state, 2, torch.randn(B, HKV, 1, D), valid[:, t : t + 1])
        probs, self_p = obs[s]
        # H = HKV * 2: split each KV head's weight over its two query heads
        slot = probs.gather(-1, sel.indices) * sel.valid
        per_head = (slot / 2).repeat_interleave(2, dim=1)
        pol.observe(state, 2, sel, per_head, (self_p / 2).repeat_interleave(2, dim=1))
    want = _h2o_reference(acc0, kept0, obs, budget, 0.5, valid)
    assert got == want
    # a position evicted once never comes back
    for s in range(1, steps):
        for b in range(B):
            for h in range(HKV):
                old = set(range(t0 + s - 1))
                assert not ((old - got[s - 1][b][h]) & got[s][b][h])


def test_quest_pages_bound_every_dot_product_and_match_a_loop():
    torch.manual_seed(1)
    t, page, budget = 37, 4, 0.25
    valid = padded_valid(t, pad=5)
    keys = torch.randn(B, HKV, t, D)
    pol = QuestSelector(QuestKnobs(budget=budget, page_tokens=page), adapter())
    state = pol.new_state(2)
    pol.on_append(state, 2, keys[:, :, :20], valid[:, :20])  # in two pieces, as prefill then decode
    for p in range(20, t):
        pol.on_append(state, 2, keys[:, :, p : p + 1], valid[:, p : p + 1])
    q = torch.randn(B, H, D)
    sel = pol.select(state, 2, q, t, heads(valid))
    got = as_sets(sel)
    n_pages = -(-t // page)
    for b in range(B):
        ctx = int(valid[b].sum())
        want_pages = -(-count(ctx, budget) // page)
        for kh in range(HKV):
            bounds = []
            for pg in range(n_pages):
                pos = [p for p in range(pg * page, min(t, (pg + 1) * page)) if valid[b, p]]
                if not pos:
                    bounds.append(-math.inf)
                    continue
                lo = keys[b, kh, pos].min(0).values
                hi = keys[b, kh, pos].max(0).values
                best = -math.inf
                for qh in range(kh * 2, kh * 2 + 2):
                    ub = sum(max(float(q[b, qh, c] * hi[c]), float(q[b, qh, c] * lo[c])) for c in range(D))
                    # the bound holds for every real key of the page
                    assert all(float(q[b, qh] @ keys[b, kh, p]) <= ub + 1e-5 for p in pos)
                    best = max(best, ub)
                bounds.append(best)
            order = sorted(range(n_pages), key=lambda pg: (-bounds[pg], pg))
            pages = [pg for pg in order[:want_pages] if bounds[pg] > -math.inf]
            want = {p for pg in pages for p in range(pg * page, min(t, (pg + 1) * page)) if valid[b, p]}
            assert got[b][kh] == want


def _oracle_reference(q, keys, valid, budget):
    out = []
    for b in range(B):
        real = [p for p in range(keys.shape[2]) if valid[b, p]]
        k = count(len(real), budget)
        row = []
        for kh in range(HKV):
            mass = {p: 0.0 for p in real}
            for qh in range(kh * 2, kh * 2 + 2):
                s = torch.tensor([float(q[b, qh] @ keys[b, kh, p]) * D**-0.5 for p in real])
                w = torch.softmax(s, 0)
                for p, wp in zip(real, w.tolist(), strict=True):
                    mass[p] += wp
            row.append(set(sorted(real, key=lambda p: (-mass[p], p))[:k]))
        out.append(row)
    return out


def test_oracle_is_the_true_top_k_and_no_policy_recalls_more():
    torch.manual_seed(2)
    t, budget = 48, 0.2
    valid = padded_valid(t)
    keys = torch.randn(B, HKV, t, D) * 2
    q = torch.randn(B, H, D) * 2
    oracle = OracleSelector(UnitSelection(budget=budget), adapter())
    st = oracle.new_state(2)
    oracle.on_append(st, 2, keys, valid)
    sel = oracle.select(st, 2, q, t, heads(valid))
    assert as_sets(sel) == _oracle_reference(q, keys, valid, budget)

    # true attention weights over the cached positions, per query head
    kr = keys.repeat_interleave(2, 1)
    s = torch.einsum("bhd,bhtd->bht", q, kr) * D**-0.5
    true = torch.softmax(s.masked_fill(~valid[:, None], -math.inf), -1)
    best = attention_recall(true, sel).mean().item()
    others = {}
    quest = QuestSelector(QuestKnobs(budget=budget, page_tokens=4), adapter())
    qs = quest.new_state(2)
    quest.on_append(qs, 2, keys, valid)
    others["quest"] = quest.select(qs, 2, q, t, heads(valid))
    others["streaming"] = StreamingSelector(StreamingKnobs(budget=budget, sinks=2), adapter()).select(
        None, 2, None, t, heads(valid)
    )
    h2o = H2OSelector(H2OKnobs(budget=budget), adapter())
    hs = h2o.new_state(2)
    h2o.on_append(hs, 2, keys, valid)
    h2o.on_prefill(hs, 2, Weights(torch.rand(B, HKV, t)))
    others["h2o"] = h2o.select(hs, 2, None, t, heads(valid))
    # InfiniGen's rule on noisy scores (a speculation), at the same cap
    noisy = aggregate_group(s + 0.5 * torch.randn_like(s), heads(valid), HKV, "union")
    others["infinigen"] = select_positions(noisy, heads(valid), alpha=3.0, budget=budget, min_tokens=1)
    for name, other in others.items():
        # compare at equal size: oracle's count is the budget; trim nothing, quest may overshoot
        # by part of a page, so give the oracle that many too
        n = int(other.counts.max())
        orc = oracle.select(st, 2, q, t, heads(valid)) if n <= sel.counts.max() else _bigger(oracle, st, q, t, valid, n)
        assert attention_recall(true, orc).mean().item() >= attention_recall(true, other).mean().item() - 1e-6, name
    assert best > attention_recall(true, others["streaming"]).mean().item()


@pytest.mark.parametrize("block", [4, 5])
def test_the_oracle_in_units_keeps_the_units_of_most_true_mass(block):
    """With `block_tokens`, the oracle keeps the aligned units whose true attention mass (summed
    over the group) is largest, as many as the budget's share of the units, and every valid row
    of them: the bound of any selector choosing in those units."""

    torch.manual_seed(3)
    t, budget = 47, 0.25
    valid = padded_valid(t)
    keys = torch.randn(B, HKV, t, D) * 2
    q = torch.randn(B, H, D) * 2
    oracle = OracleSelector(UnitSelection(budget=budget, block_tokens=block), adapter())
    st = oracle.new_state(2)
    oracle.on_append(st, 2, keys, valid)
    sel = oracle.select(st, 2, q, t, heads(valid))
    s = torch.einsum("bhd,bhtd->bht", q, keys.repeat_interleave(2, 1)) * D**-0.5
    mass = torch.softmax(s.masked_fill(~valid[:, None], -math.inf), -1).reshape(B, HKV, 2, t).sum(2)
    units = [list(range(u, min(u + block, t))) for u in range(0, t, block)]
    for b in range(B):
        live = [u for u in units if any(valid[b, p] for p in u)]
        k = math.ceil(len(live) * budget)
        for h in range(HKV):
            best = sorted(live, key=lambda u: -sum(mass[b, h, p].item() for p in u))[:k]
            want = {p for u in best for p in u if valid[b, p]}
            assert as_sets(sel)[b][h] == want


def _bigger(oracle, state, q, t, valid, n):
    return OracleSelector(UnitSelection(budget=1.0, budget_tokens=n), oracle.adapter).select(
        state, 2, q, t, heads(valid)
    )


def test_selection_mask_round_trip():
    valid = padded_valid(20)
    pol = StreamingSelector(StreamingKnobs(budget=0.3, sinks=2), adapter())
    sel = pol.select(None, 2, None, 20, heads(valid))
    mask = selection_mask(sel, 20)
    assert mask.sum().item() == sel.valid.sum().item()
    assert not (mask & ~valid[:, None]).any()
