"""The C selection kernel equals the tensor operations it replaces (infinigen.speculate)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from conftest import VOCAB, tiny_model
from infinigen import InfiniGenConfig, attach, kernels
from infinigen.compat import cache_kwargs
from infinigen.speculate import aggregate_group, all_valid, partial_scores, select_blocks, select_positions, top_up


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    if not kernels.available():
        if os.environ.get("CI"):
            pytest.fail("the C selection kernel must build on CI (a C compiler is installed)")
        pytest.skip("no C compiler: the kernel is unavailable here")


def _case(seed: int, b=2, hkv=2, g=3, c=5, t=40, room=None, padded=True):
    """Integer-valued keys and queries: every sum is exact in fp32, so ties are real ties and
    the kernel and the tensor path must agree bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    room = room or t + 7
    keys = torch.randint(-3, 4, (b, hkv, c, room), generator=gen).float()
    query = torch.randint(-2, 3, (b, hkv * g, c), generator=gen).float()
    valid = torch.ones(b, hkv, t, dtype=torch.bool)
    if padded and t > 3:
        valid[1, :, : t // 4] = False  # left padding of the second row
        valid[0, 1, t // 2] = False  # a position a capped pool forgot
    return keys, query, valid


def _reference(keys, query, valid, t, agg, alpha, budget, budget_tokens, min_tokens):
    kp = keys[..., :t].transpose(-1, -2)
    s = partial_scores(query, kp, 1.0)
    g = aggregate_group(s, valid, keys.shape[1], agg)
    return select_positions(g, valid, alpha, budget, budget_tokens, min_tokens), g


def _assert_same_up_to_rounding(ref, idx, counts, g, valid):
    """The kernel's rows equal the reference's wherever the reference's ranking is not within
    rounding of its cut (`mass` goes through the kernel's own exp and log)."""
    assert torch.equal(counts, ref.counts)
    b, hkv, t = valid.shape
    for bb in range(b):
        for h in range(hkv):
            if not counts[bb, h]:
                continue
            want = set(ref.indices[bb, h, : ref.counts[bb, h]].tolist())
            got = set(idx[bb, h, : counts[bb, h]].tolist())
            cut = g[bb, h, sorted(want)].min()
            tol = 1e-4 * max(1.0, float(cut.abs()))
            near = {p for p in range(t) if valid[bb, h, p] and abs(g[bb, h, p] - cut) < tol}
            assert want ^ got <= near


SETTINGS = [
    (4.0, 1.0, None, 1),
    (2.0, 0.25, None, 3),
    (math.inf, 0.1, None, 1),
    (0.5, 1.0, 6, 12),
    (3.0, 0.5, 7, 2),
]


@pytest.mark.parametrize("agg", ["union", "max", "sum"])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("t", [1, 9, 40, 300])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_equals_tensor_path(agg, setting, t, padded):
    alpha, budget, budget_tokens, min_tokens = setting
    for seed in range(3):
        keys, query, valid = _case(seed, t=t, padded=padded)
        ref, _ = _reference(keys, query, valid, t, agg, alpha, budget, budget_tokens, min_tokens)
        idx, counts = kernels.select(
            keys, t, query, valid if padded else None, agg, alpha, budget, budget_tokens, min_tokens
        )
        assert torch.equal(counts, ref.counts)
        n = idx.shape[-1]
        assert n == ref.indices.shape[-1]
        slots = torch.arange(n) < counts[..., None]
        assert torch.equal(torch.where(slots, idx, 0), ref.indices)
        assert not idx[~slots].any()  # padding slots hold 0


@pytest.mark.parametrize("agg,rule", [("union", "max"), ("max", "max"), ("max", "top2"), ("union", "top2")])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("t", [1, 9, 40, 300])
@pytest.mark.parametrize("block", [2, 5, 16])
def test_kernel_block_selection_equals_tensor_path(agg, rule, setting, t, block):
    """Aligned units (scored by their best valid position, or the mean of their two best;
    budget, cap and floor count units): the same positions as `speculate.select_blocks`,
    compact and ascending."""
    alpha, budget, budget_tokens, min_tokens = setting
    for seed in range(3):
        keys, query, valid = _case(seed, t=t)
        kp = keys[..., :t].transpose(-1, -2)
        g = aggregate_group(partial_scores(query, kp, 1.0), valid, keys.shape[1], agg)
        ref = select_blocks(g, valid, block, alpha, budget, budget_tokens, min_tokens, rule)
        idx, counts = kernels.select(
            keys, t, query, valid, agg, alpha, budget, budget_tokens, min_tokens, block=block, unit_score=rule
        )
        for b in range(valid.shape[0]):
            for h in range(valid.shape[1]):
                want = sorted(int(p) for p, v in zip(ref.indices[b, h], ref.valid[b, h]) if v)
                assert idx[b, h, : counts[b, h]].tolist() == want


@pytest.mark.parametrize("agg", ["max", "mass"])
@pytest.mark.parametrize("block", [4, 16])
def test_kernel_units_by_mass_are_the_best_units_up_to_rounding(agg, block):
    """Units scored by their mass (logsumexp, in the kernel's own float exp and log, torch's in
    the tensor path): every unit the kernel chooses scores, by the tensor path's rule, at least as well as
    every unit it leaves, up to rounding; and it chooses as many units."""
    from infinigen.speculate import unit_scores

    t, budget = 700, 0.1
    for seed in range(4):
        keys, query, valid = _case(seed, t=t)
        keys = keys * 0.37  # a spread of distinct values
        kp = keys[..., :t].transpose(-1, -2)
        g = aggregate_group(partial_scores(query, kp, 1.0), valid, keys.shape[1], agg)
        scores, unit_ok = unit_scores(g, valid, block, "mass")
        want = select_blocks(g, valid, block, math.inf, budget, None, 1, "mass")
        idx, counts = kernels.select(
            keys, t, query, valid, agg, math.inf, budget, None, 1, block=block, unit_score="mass"
        )
        for b in range(valid.shape[0]):
            for h in range(valid.shape[1]):
                got = {int(p) // block for p in idx[b, h, : counts[b, h]]}
                ref = {int(p) // block for p, v in zip(want.indices[b, h], want.valid[b, h]) if v}
                assert len(got) == len(ref)
                left = [u for u in range(scores.shape[-1]) if u not in got and unit_ok[b, h, u]]
                worst_in = min(scores[b, h, u].item() for u in got)
                best_out = max((scores[b, h, u].item() for u in left), default=-math.inf)
                assert worst_in >= best_out - 1e-4


@pytest.mark.parametrize("t", [200, 5000])
@pytest.mark.parametrize("spread", [0.37, 6.0])
def test_kernel_mass_aggregation_matches_up_to_rounding(t, spread):
    """`mass` goes through exp and log (the kernel's own float polynomials), whose rounding
    differs: the selections agree wherever the reference's ranking is not within rounding of its
    cut. A wide spread drives most probabilities below float's range; a long row exercises the
    kernel's blocked sums."""
    for seed in range(4):
        keys, query, valid = _case(seed, t=t)
        keys = keys * spread  # non-integer scores: a spread of distinct values
        ref, g = _reference(keys, query, valid, t, "mass", math.inf, 0.1, None, 1)
        idx, counts = kernels.select(keys, t, query, valid, "mass", math.inf, 0.1, None, 1)
        _assert_same_up_to_rounding(ref, idx, counts, g, valid)


@pytest.mark.parametrize("agg", ["max", "mass"])
def test_kernel_ties_at_the_cut_never_crowd_out_a_higher_score(agg):
    """As in the tensor path: a later, higher score is kept; the ties fill the rest, earliest first."""
    keys = torch.full((1, 1, 1, 12), 1.0)
    keys[0, 0, 0, 0], keys[0, 0, 0, 11] = 3.0, 2.0
    idx, counts = kernels.select(keys, 12, torch.ones(1, 1, 1), None, agg, math.inf, 4 / 12, None, 1)
    assert counts.tolist() == [[4]] and idx[0, 0].tolist() == [0, 1, 2, 11]


@pytest.mark.parametrize("budget", [1 / 9, 0.5, 8 / 9])
def test_kernel_cut_is_exact_over_signs_zeros_and_extremes(budget):
    """The cut is the count-th largest score by float order: negative and positive, both zeros,
    subnormals, the largest floats and -inf all rank as the tensor path ranks them."""
    tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    values = [0.0, -0.0, 1e-45, -1e-45, tiny, -tiny, big, -big, -math.inf, 3.5, -3.5, 0.0, -0.0, 2.0, 2.0, -7.25]
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        row = torch.tensor(values)[torch.randperm(len(values), generator=gen)]
        keys = row.reshape(1, 1, 1, -1).contiguous()
        query = torch.ones(1, 1, 1)
        t = row.numel()
        valid = torch.ones(1, 1, t, dtype=torch.bool)
        ref, _ = _reference(keys, query, valid, t, "max", math.inf, budget, None, 1)
        idx, counts = kernels.select(keys, t, query, None, "max", math.inf, budget, None, 1)
        assert torch.equal(counts, ref.counts)
        assert torch.equal(idx, ref.indices)


def test_kernel_refuses_a_group_wider_than_it_takes():
    """More query heads per KV head than the kernel's MAX_GROUP: a clear error, never garbage
    (the selector sends such models to the tensor path)."""
    g = kernels.MAX_GROUP + 1
    keys = torch.zeros(1, 1, 4, 10)
    with pytest.raises(ValueError, match="GQA group"):
        kernels.select(keys, 10, torch.zeros(1, g, 4), None, "max", 1.0, 1.0, None, 1)


def test_kernel_all_valid_view_equals_explicit_mask_and_honours_capacity():
    keys, query, _ = _case(5, t=64, room=100, padded=False)
    full = torch.ones(2, 2, 64, dtype=torch.bool)
    a = kernels.select(keys, 64, query, None, "union", 3.0, 1.0, None, 2)
    b = kernels.select(keys, 64, query, full, "union", 3.0, 1.0, None, 2)
    ref, _ = _reference(keys, query, all_valid(2, 2, 64), 64, "union", 3.0, 1.0, None, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[0], ref.indices)
    with pytest.raises(ValueError, match="capacity"):
        kernels.select(keys, 101, query, None, "union", 3.0, 1.0, None, 2)


def _chosen_and_counts(seed: int, valid: torch.Tensor):
    """A speculated selection to top up (some positions already chosen) and per-row counts,
    from none to more than the open positions."""
    gen = torch.Generator().manual_seed(100 + seed)
    chosen = (torch.rand(valid.shape, generator=gen) < 0.3) & valid
    t = valid.shape[-1]
    count = torch.tensor([[0, 1], [max(1, t // 5), 2 * t]])
    return chosen, count


@pytest.mark.parametrize("agg", ["union", "max", "sum"])
@pytest.mark.parametrize("t", [1, 9, 40, 300])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_top_up_equals_tensor_path(agg, t, padded):
    """The correction's top-up: the same positions as `speculate.top_up`, ties (integer scores
    tie often) included, every row count from none to more than is open."""
    for seed in range(3):
        keys, query, valid = _case(seed, t=t, padded=padded)
        chosen, count = _chosen_and_counts(seed, valid)
        _, g = _reference(keys, query, valid, t, agg, math.inf, 1.0, None, 1)
        ref = top_up(g, valid, chosen, count)
        idx, counts = kernels.top_up(keys, t, query, valid if padded else None, agg, chosen, count)
        assert torch.equal(counts, ref.counts)
        n = idx.shape[-1]
        assert n == ref.indices.shape[-1]
        slots = torch.arange(n) < counts[..., None]
        assert torch.equal(torch.where(slots, idx, 0), ref.indices)
        assert not idx[~slots].any()
        picked = torch.zeros_like(valid).scatter_(-1, idx, slots)
        assert not (picked & chosen).any() and not (picked & ~valid).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_top_up_mass_matches_up_to_rounding(dtype):
    t = 2000
    for seed in range(3):
        keys, query, valid = _case(seed, t=t)
        keys = (keys * 0.37).to(dtype)
        chosen, count = _chosen_and_counts(seed, valid)
        _, g = _reference(keys.float(), query, valid, t, "mass", math.inf, 1.0, None, 1)
        ref = top_up(g, valid, chosen, count)
        idx, counts = kernels.top_up(keys, t, query, valid, "mass", chosen, count)
        _assert_same_up_to_rounding(ref, idx, counts, g, valid)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_widens_every_16_bit_pattern_exactly(dtype):
    """The partial keys may be kept in 16 bits: the kernel's integer-only widening equals
    torch's conversion on all 65536 patterns (zeros, subnormals, normals, infinities; NaNs stay
    NaN)."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    want, got = patterns.float(), kernels.widen(patterns.contiguous())
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))  # bit for bit (signed zeros too)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("agg", ["union", "mass"])
@pytest.mark.parametrize("t", [9, 300, 5000])
def test_kernel_on_16_bit_keys_equals_its_float32_run_on_the_widened_keys(dtype, agg, t):
    keys, query, valid = _case(7, t=t)
    keys16 = (keys * 0.37).to(dtype)  # non-integer values, so that widening errors would show
    for budget in (0.05, 0.2, 1.0):
        a = kernels.select(keys16, t, query, valid, agg, 4.0, budget, None, 1)
        b = kernels.select(keys16.float(), t, query, valid, agg, 4.0, budget, None, 1)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("kv_dtype, correction", [("float16", 0.0), ("bfloat16", 0.0), ("float16", 0.05), (None, 0.05)])
def test_decode_is_the_same_through_the_kernels_and_the_tensor_path(kv_dtype, correction, monkeypatch):
    """With a 16-bit KV the partial keys are kept in 16 bits; the kernel widens them as the
    tensor path does, and a correction's top-up picks the same rows, so a decode selects the
    same rows and yields the same logits."""
    ids = torch.randint(3, VOCAB, (1, 160), generator=torch.Generator().manual_seed(11))
    cfg = InfiniGenConfig(budget=0.1, calibration_tokens=64, kv_dtype=kv_dtype, correction=correction)
    calls = {"select": 0, "top_up": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    runs = []
    for enabled in ("1", "0"):
        monkeypatch.setenv("INFINIGEN_KERNELS", enabled)
        model = tiny_model("llama")
        with attach(model, cfg, progress=False) as session, session.new_cache() as cache:
            out = model.generate(
                input_ids=ids, **cache_kwargs(model, cache), max_new_tokens=12, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            summary = cache.summary()
        runs.append((out.sequences, torch.stack(out.logits), summary["selector_bytes"], summary["correction_bytes"]))
        if enabled == "1":  # the kernels ran (the second run is the tensor path's alone)
            assert calls["select"] > 0 and (calls["top_up"] > 0) == (correction > 0)
            calls.update(select=0, top_up=0)
    assert calls == {"select": 0, "top_up": 0}
    (seq_c, logits_c, held_c, topped_c), (seq_t, logits_t, held_t, topped_t) = runs
    assert torch.equal(seq_c, seq_t) and held_c == held_t and topped_c == topped_t
    assert (topped_c > 0) == (correction > 0)
    torch.testing.assert_close(logits_c, logits_t, rtol=1e-5, atol=1e-5)
