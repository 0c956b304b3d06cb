"""Selection math against brute-force loops on small tensors."""

import math

import pytest
import torch

from infinigen.speculate import (
    aggregate_group,
    attention_column_sums,
    attention_recall,
    partial_scores,
    select_positions,
)


def skew_partial(x, skew, channels):
    """Reference: skew every head (its KV head's matrix), then gather that head's channels."""
    group = x.shape[1] // channels.shape[0]
    if skew is not None:
        x = torch.einsum("bhtd,hde->bhte", x, skew.repeat_interleave(group, dim=0))
    idx = channels.repeat_interleave(group, dim=0)[None, :, None, :].expand(x.shape[0], -1, x.shape[2], -1)
    return torch.gather(x, -1, idx)


def per_head(valid, hkv):
    """[B, T] token validity as the [B, Hkv, T] the selection math takes."""
    return valid[:, None, :].expand(valid.shape[0], hkv, valid.shape[1])


def brute_select(g_row, valid_row, alpha, budget, budget_tokens, min_tokens):
    """Reference for one (batch, KV head) row, written as plainly as possible."""
    positions = [p for p in range(len(g_row)) if valid_row[p]]
    ctx = len(positions)
    if ctx == 0:
        return set()
    top = max(g_row[p] for p in positions)
    kept = [p for p in positions if g_row[p] >= top - alpha]
    cap = math.ceil(ctx * budget)
    if budget_tokens is not None:
        cap = min(cap, budget_tokens)
    count = min(len(kept), cap)
    count = max(count, min(ctx, min_tokens))
    ranked = sorted(positions, key=lambda p: -g_row[p])
    return set(ranked[:count])


def random_case(seed, b=2, h=6, hkv=2, t=40):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, h, t, generator=g) * 3
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :7] = False  # left padding on the second row
    return scores, per_head(valid, hkv), hkv


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    "alpha,budget,budget_tokens,min_tokens",
    [(2.0, 1.0, None, 1), (4.0, 0.1, None, 1), (0.5, 1.0, 5, 12), (3.0, 0.5, 7, 2)],
)
def test_threshold_cap_floor_match_brute_force(seed, alpha, budget, budget_tokens, min_tokens):
    scores, valid, hkv = random_case(seed)
    g = aggregate_group(scores, valid, hkv, "max")
    sel = select_positions(g, valid, alpha, budget, budget_tokens, min_tokens)
    for b in range(g.shape[0]):
        for k in range(hkv):
            got = {int(p) for p, v in zip(sel.indices[b, k], sel.valid[b, k]) if v}
            want = brute_select(g[b, k].tolist(), valid[b, k].tolist(), alpha, budget, budget_tokens, min_tokens)
            assert got == want
            # Ascending order among valid slots, padding never selected.
            ordered = [int(p) for p, v in zip(sel.indices[b, k], sel.valid[b, k]) if v]
            assert ordered == sorted(ordered)
            assert all(valid[b, k, p] for p in ordered)


def test_ties_at_the_cut_never_crowd_out_a_higher_score():
    """Many positions tied at the count-th score, one higher score after them: the higher one is
    kept and the ties fill the rest of the count, earliest first."""
    g = torch.full((1, 1, 12), 1.0)
    g[0, 0, 0] = 3.0
    g[0, 0, 11] = 2.0  # above every tie, after them
    valid = torch.ones(1, 1, 12, dtype=torch.bool)
    sel = select_positions(g, valid, math.inf, budget=4 / 12)
    assert sel.indices[0, 0][sel.valid[0, 0]].tolist() == [0, 1, 2, 11]


@pytest.mark.parametrize("seed", range(3))
def test_positions_missing_for_one_head_only_are_never_selected(seed):
    """A capped pool evicts per KV head: each head selects among its own positions, its
    budget a fraction of them."""
    scores, valid, hkv = random_case(seed)
    valid = valid.clone()
    gen = torch.Generator().manual_seed(seed)
    valid &= torch.rand(valid.shape, generator=gen) > 0.3
    g = aggregate_group(scores, valid, hkv, "union")
    sel = select_positions(g, valid, 3.0, budget=0.25, min_tokens=2)
    for b in range(g.shape[0]):
        for k in range(hkv):
            got = {int(p) for p, v in zip(sel.indices[b, k], sel.valid[b, k]) if v}
            assert got == brute_select(g[b, k].tolist(), valid[b, k].tolist(), 3.0, 0.25, None, 2)


@pytest.mark.parametrize("seed", range(3))
def test_group_aggregations_match_definitions(seed):
    scores, valid, hkv = random_case(seed)
    group = scores.shape[1] // hkv
    alpha = 2.5
    for how in ("max", "sum", "union", "mass"):
        g = aggregate_group(scores, valid, hkv, how)
        sel = select_positions(g, valid, alpha)
        for b in range(scores.shape[0]):
            pos = [p for p in range(scores.shape[2]) if valid[b, 0, p]]
            for k in range(hkv):
                heads = scores[b, k * group : (k + 1) * group]
                if how == "max":
                    agg = {p: max(heads[j, p].item() for j in range(group)) for p in pos}
                    top = max(agg.values())
                    want = {p for p in pos if agg[p] >= top - alpha}
                elif how == "sum":
                    agg = {p: sum(heads[j, p].item() for j in range(group)) for p in pos}
                    top = max(agg.values())
                    want = {p for p in pos if agg[p] >= top - alpha}
                elif how == "mass":
                    # summed softmax probabilities over the real positions, head by head
                    mass = {p: 0.0 for p in pos}
                    for j in range(group):
                        z = sum(math.exp(heads[j, q].item()) for q in pos)
                        for p in pos:
                            mass[p] += math.exp(heads[j, p].item()) / z
                    top = max(mass.values())
                    want = {p for p in pos if mass[p] >= top * math.exp(-alpha)}
                else:
                    want = set()
                    for j in range(group):
                        top = max(heads[j, p].item() for p in pos)
                        want |= {p for p in pos if heads[j, p].item() >= top - alpha}
                got = {int(p) for p, v in zip(sel.indices[b, k], sel.valid[b, k]) if v}
                assert got == want, how


def test_mass_ranks_padded_and_empty_rows_safely():
    scores, valid, hkv = random_case(4)
    valid = valid.clone()
    valid[0] = False  # a row without any real position: no NaN, nothing selected
    g = aggregate_group(scores, valid, hkv, "mass")
    assert torch.isneginf(g[0]).all() and torch.isneginf(g[1, :, :7]).all()
    assert torch.isfinite(g[1, :, 7:]).all()
    # the group's probability masses sum to the group size
    assert torch.allclose(g[1, :, 7:].exp().sum(-1), torch.full((hkv,), scores.shape[1] / hkv))
    sel = select_positions(g, valid, math.inf, budget=0.2)
    assert sel.counts[0].tolist() == [0, 0] and sel.counts[1].tolist() == [7, 7]


def test_union_contains_max_selection():
    scores, valid, hkv = random_case(7)
    s_max = select_positions(aggregate_group(scores, valid, hkv, "max"), valid, 3.0)
    s_uni = select_positions(aggregate_group(scores, valid, hkv, "union"), valid, 3.0)
    assert (s_uni.counts >= s_max.counts).all()


def test_infinite_alpha_selects_every_real_position():
    scores, valid, hkv = random_case(3)
    sel = select_positions(aggregate_group(scores, valid, hkv, "union"), valid, math.inf)
    assert sel.counts.tolist() == [[40, 40], [33, 33]]


def test_all_padding_row_selects_nothing():
    scores = torch.randn(1, 2, 5)
    valid = torch.zeros(1, 1, 5, dtype=torch.bool)
    sel = select_positions(aggregate_group(scores, valid, 1, "max"), valid, 4.0, min_tokens=3)
    assert sel.counts.sum() == 0


def test_partial_scores_equal_full_scores_with_all_channels():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 8, generator=g)
    k = torch.randn(2, 2, 10, 8, generator=g)
    a = torch.linalg.qr(torch.randn(2, 8, 8, generator=g)).Q
    ch = torch.arange(8).repeat(2, 1)
    qp = skew_partial(q, a, ch)[:, :, 0]
    kp = skew_partial(k, a, ch)
    got = partial_scores(qp, kp, 0.5)
    want = torch.einsum("bhd,bhtd->bht", q[:, :, 0], k.repeat_interleave(2, dim=1)) * 0.5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_recall_is_mass_on_selected_positions():
    probs = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])  # [B=1, H=2, T=3], one KV head
    scores = torch.log(probs)
    valid = torch.ones(1, 1, 3, dtype=torch.bool)
    sel = select_positions(aggregate_group(scores, valid, 1, "max"), valid, 0.0, min_tokens=1)
    rec = attention_recall(probs, sel)
    assert sel.counts.item() == 1 and int(sel.indices[0, 0, 0]) == 2
    torch.testing.assert_close(rec, torch.tensor([[0.2, 0.8]]))


def test_partial_projection_equals_skew_then_gather():
    from infinigen.speculate import partial_projection, project_partial

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 5, 8, generator=g)
    a = torch.linalg.qr(torch.randn(3, 8, 8, generator=g)).Q
    ch = torch.tensor([[0, 3, 7], [1, 2, 4], [5, 6, 7]])
    torch.testing.assert_close(project_partial(x, partial_projection(a, ch, 8)), skew_partial(x, a, ch))
    # Without a skew the projection only picks channels, bit for bit.
    assert torch.equal(project_partial(x, partial_projection(None, ch, 8)), skew_partial(x, None, ch))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block", [1, 4, 5])
def test_block_selection_matches_brute_force(seed, block):
    from infinigen.speculate import select_blocks

    scores, valid, hkv = random_case(seed, t=37)
    g = aggregate_group(scores, valid, hkv, "union")
    alpha, budget, budget_tokens, min_tokens = 1.5, 0.6, 20, 6
    sel = select_blocks(g, valid, block, alpha, budget, budget_tokens, min_tokens)
    t = g.shape[-1]
    for b in range(g.shape[0]):
        blocks = [list(range(s, min(s + block, t))) for s in range(0, t, block)]
        for k in range(hkv):
            blk_scores = [max((g[b, k, p].item() for p in blk if valid[b, k, p]), default=-math.inf) for blk in blocks]
            blk_valid = [any(valid[b, k, p] for p in blk) for blk in blocks]
            if block == 1:
                want = brute_select(g[b, k].tolist(), valid[b, k].tolist(), alpha, budget, budget_tokens, min_tokens)
            else:
                chosen = brute_select(
                    blk_scores, blk_valid, alpha, budget, max(1, budget_tokens // block), -(-min_tokens // block)
                )
                want = {p for i in chosen for p in blocks[i] if valid[b, k, p]}
            got = {int(p) for p, v in zip(sel.indices[b, k], sel.valid[b, k]) if v}
            assert got == want


@pytest.mark.parametrize("q_len,chunk", [(37, 8), (37, 256), (12, 5)])
def test_prefill_column_sums_match_the_full_softmax(q_len, chunk):
    """H2O's prefill statistic against a plain full-width reference: causal, GQA-summed,
    left padding excluded both as keys and as queries."""
    g = torch.Generator().manual_seed(q_len + chunk)
    b, hkv, group, k_len, d = 2, 2, 3, 37, 8
    query = torch.randn(b, hkv * group, q_len, d, generator=g)
    key = torch.randn(b, hkv, k_len, d, generator=g).to(torch.float16)
    valid = torch.ones(b, k_len, dtype=torch.bool)
    valid[1, :6] = False  # the second sequence is left-padded
    got = attention_column_sums(query, key, valid, 0.3, chunk=chunk)

    k = key.float().repeat_interleave(group, dim=1)
    s = query @ k.transpose(-1, -2) * 0.3
    rows = torch.arange(k_len - q_len, k_len)
    allowed = (torch.arange(k_len)[None, :] <= rows[:, None])[None, None] & valid[:, None, None, :]
    probs = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    probs = probs * valid[:, k_len - q_len :][:, None, :, None]
    want = probs.sum(2).reshape(b, hkv, group, k_len).sum(2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _unit_score(values: list[float], rule: str) -> float:
    """A unit's score from its valid rows' scores, written plainly (speculate.unit_scores)."""
    if not values:
        return -math.inf
    best = sorted(values, reverse=True)
    if rule == "max":
        return best[0]
    if rule == "top2":
        return (best[0] + best[1]) / 2 if len(best) > 1 else best[0]
    top = best[0]
    return top + math.log(sum(math.exp(v - top) for v in values))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rule", ["max", "mass", "top2"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("block", [1, 4, 5])
def test_units_are_chosen_by_their_rule_and_read_whole(seed, rule, shared, block):
    """Units scored by max, mass or top-2 of their rows, each KV head's own or one choice for a
    token's heads (heads' scores as log-probabilities first): the chosen units are the best by a
    plain reference of the rule, and every valid row of a chosen unit is selected."""
    from infinigen.speculate import select_blocks

    scores, valid, hkv = random_case(seed, t=37)
    g = aggregate_group(scores, valid, hkv, "max")
    budget, budget_tokens, min_tokens = 0.3, 40, 6
    sel = select_blocks(g, valid, block, math.inf, budget, budget_tokens, min_tokens, rule, shared)
    t = g.shape[-1]
    units = [list(range(s, min(s + block, t))) for s in range(0, t, block)]
    for b in range(g.shape[0]):
        if shared:
            logp = torch.log_softmax(g[b].masked_fill(~valid[b], -math.inf), -1)
            rows = [[(k, p) for k in range(hkv) for p in unit if valid[b, k, p]] for unit in units]
            unit_s = [_unit_score([logp[k, p].item() for k, p in r], rule) for r in rows]
            chosen = brute_select(
                unit_s, [bool(r) for r in rows], math.inf, budget, max(1, budget_tokens // block),
                -(-min_tokens // block),
            )  # fmt: skip
            wants = [{p for i in chosen for p in units[i] if valid[b, k, p]} for k in range(hkv)]
        else:
            wants = []
            for k in range(hkv):
                rows = [[g[b, k, p].item() for p in unit if valid[b, k, p]] for unit in units]
                unit_s = [_unit_score(r, rule) for r in rows]
                chosen = brute_select(
                    unit_s, [bool(r) for r in rows], math.inf, budget, max(1, budget_tokens // block),
                    -(-min_tokens // block),
                )  # fmt: skip
                wants.append({p for i in chosen for p in units[i] if valid[b, k, p]})
        for k in range(hkv):
            got = {int(p) for p, v in zip(sel.indices[b, k], sel.valid[b, k]) if v}
            assert got == wants[k]
        if shared:  # one choice: every head holds the same positions wherever they are valid
            both = [{p for p in wants[k] if all(valid[b, j, p] for j in range(hkv))} for k in range(hkv)]
            assert all(s == both[0] for s in both)
