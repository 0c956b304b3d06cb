"""The kernels that read where the data lies (select.c's `ig_select_codes`, attend.c's
`ig_attend_rows`) against the tensor path: the integer scores of 4-bit codes (`code_scores`), the
library's selection rule, dense attention; on every instruction path this CPU has (each must equal
the portable one bit for bit), on one thread and on several, in the library's contiguous buffers
and in an engine's pages reached through block tables."""

from __future__ import annotations

import math
import os

import pytest
import torch

from infinigen import kernels
from infinigen.select.quantized import code_scores
from infinigen.speculate import aggregate_group, select_positions, top_up


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    if not kernels.available():
        if os.environ.get("CI"):
            pytest.fail("the C kernels must build on CI (a C compiler is installed)")
        pytest.skip("no C compiler: the kernels are unavailable here")


def _paths() -> list[str]:
    """Every instruction path this CPU runs, the portable one first."""
    best = kernels.ISA_PATHS.index(kernels.best_isa())
    out = []
    for name in kernels.ISA_PATHS[: best + 1]:
        with kernels.isa_cap(name):
            if kernels.isa() == name:
                out.append(name)
    return out


def _case(seed: int, b=2, hkv=2, g=3, pairs=5, t=300, room=None):
    gen = torch.Generator().manual_seed(seed)
    cap = room or t + 9
    codes = torch.randint(0, 256, (b, hkv, pairs, cap), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(b, hkv, 1, cap, generator=gen) + 0.05).to(torch.float16)
    query = torch.randn(b, hkv, g, 2 * pairs, generator=gen) * 3
    bias = torch.randn(b, hkv, g, generator=gen)
    own = torch.randn(b, hkv, g, 2 * pairs, generator=gen) * 3
    own_bias = torch.randn(b, hkv, g, generator=gen)
    return codes, scales, query, bias, own, own_bias


def _group(codes, scales, query, bias, t, valid, agg):
    b, hkv, g, c = query.shape
    s = code_scores(codes, scales, query.reshape(b, hkv * g, c), bias.reshape(b, hkv * g), t)
    return aggregate_group(s, valid, hkv, agg)


def _same_up_to_rounding(want: set, got: set, g_row: torch.Tensor, valid_row: torch.Tensor) -> None:
    """mass goes through the kernels' own exp and log: rows agree but for positions within rounding of the cut."""
    if want == got:
        return
    cut = g_row[sorted(want)].min()
    tol = 1e-4 * max(1.0, float(cut.abs()))
    near = {p for p in range(len(g_row)) if valid_row[p] and abs(g_row[p] - cut) < tol}
    assert want ^ got <= near


@pytest.mark.parametrize("agg", ["max", "union", "mass"])
@pytest.mark.parametrize("t", [1, 37, 300, 2100])
@pytest.mark.parametrize("padded", [False, True])
def test_selection_over_codes_in_place_is_the_tensor_paths_on_every_instruction_path(agg, t, padded):
    codes, scales, query, bias, own, own_bias = _case(t, t=t)
    b, hkv = codes.shape[:2]
    valid = torch.ones(b, hkv, t, dtype=torch.bool)
    if padded and t > 4:
        valid[1, :, : t // 4] = False
    lengths = torch.full((b,), t)
    correction = 0.05
    rule = kernels.Rule.of(agg, math.inf, 0.1, None, 2, correction=correction)
    g = _group(codes, scales, query, bias, t, valid, agg)
    want = select_positions(g, valid, math.inf, 0.1, None, 2)
    chosen = torch.zeros_like(valid).scatter_(-1, want.indices, want.valid) if t else valid
    ctx = valid.sum(-1)
    extra_want = top_up(_group(codes, scales, own, own_bias, t, valid, agg), valid, chosen,
                        torch.ceil(ctx.double() * correction).long())  # fmt: skip
    runs = []
    for path in _paths():
        for nthreads in (1, 3):
            with kernels.isa_cap(path):
                out = kernels.select_codes(
                    kernels.Codes.contiguous(codes, scales), lengths, query, bias, rule, own, own_bias,
                    None if not padded else valid, threads_=nthreads,
                )  # fmt: skip
            runs.append(out)
    first = runs[0]
    for other in runs[1:]:  # every path and thread count: the same positions, bit for bit
        assert all(torch.equal(x, y) for x, y in zip(first, other))
    pos, counts, extra = first
    assert torch.equal(counts, want.counts)
    g_own = _group(codes, scales, own, own_bias, t, valid, agg)
    for bb in range(b):
        for h in range(hkv):
            n = int(counts[bb, h])
            got = set(pos[bb, h, :n].tolist())
            ref = set(want.indices[bb, h][want.valid[bb, h]].tolist())
            if agg == "mass":
                _same_up_to_rounding(ref, got, g[bb, h], valid[bb, h])
            else:
                assert got == ref
            top = set(pos[bb, h, n : n + int(extra[bb, h])].tolist())
            ref_top = set(extra_want.indices[bb, h][extra_want.valid[bb, h]].tolist())
            assert not top & got and len(top) == len(ref_top)
            if agg != "mass" and got == ref:
                assert top == ref_top
            elif top != ref_top:
                _same_up_to_rounding(ref_top, top, g_own[bb, h].masked_fill(chosen[bb, h], -math.inf), valid[bb, h])


def _to_pages(codes, scales, block: int, seed: int):
    """The library's buffers laid out as an engine's pages: per (block, KV head) `pairs` rows of
    `block` bytes then `block` float16 scales, the blocks of each request scattered by a table."""
    b, hkv, pairs, cap = codes.shape
    nb = -(-cap // block)
    row = pairs + 2
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(b * nb + 5, generator=gen)[: b * nb].view(b, nb).to(torch.int32)
    page = torch.zeros(b * nb + 5, hkv, block * row, dtype=torch.uint8)
    pad = nb * block - cap
    c = torch.nn.functional.pad(codes, (0, pad)).view(b, hkv, pairs, nb, block)
    s = torch.nn.functional.pad(scales, (0, pad)).view(b, hkv, nb, block).contiguous()
    for r in range(b):
        for j in range(nb):
            blk = int(tables[r, j])
            page[blk, :, : pairs * block] = c[r, :, :, j].reshape(hkv, -1)
            page[blk, :, pairs * block :] = s[r, :, j].view(torch.uint8).reshape(hkv, -1)
    hstride = block * row
    return page, tables, kernels.Codes(
        page.data_ptr(), page.data_ptr() + pairs * block, tables.data_ptr(), nb, 0, hstride, hkv * hstride, 0,
        hstride, hkv * hstride, block, block, pairs,
    )  # fmt: skip


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("agg", ["max", "mass"])
def test_selection_through_block_tables_is_the_same_as_over_contiguous_codes(block, agg):
    t = 1000
    codes, scales, query, bias, own, own_bias = _case(5, t=t, room=t)
    lengths = torch.tensor([t, t - 77])
    rule = kernels.Rule.of(agg, math.inf, 0.15, None, 4, correction=0.03)
    flat = kernels.select_codes(kernels.Codes.contiguous(codes, scales), lengths, query, bias, rule, own, own_bias)
    page, tables, paged = _to_pages(codes, scales, block, 9)
    got = kernels.select_codes(paged, lengths, query, bias, rule, own, own_bias)
    for x, y in zip(flat, got):
        assert torch.equal(x, y)
    # a shorter request ranks only its own positions
    assert int(got[0][1].max()) < t - 77


def _dense(q, k, v, keep):
    """q [G, d] (scaled) over rows k, v [n, d] where keep [n], float64."""
    s = (q.double() @ k.double().T).masked_fill(~keep, -math.inf)
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("nthreads", [1, 4])
def test_attention_over_chosen_rows_in_place_is_dense_attention_over_them(dtype, nthreads):
    gen = torch.Generator().manual_seed(1)
    b, hkv, g, d, cap = 2, 3, 2, 64, 700
    k = torch.randn(b, hkv, cap, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, cap, d, generator=gen).to(dtype)
    q = torch.randn(b, hkv, g, d, generator=gen) * 0.3
    knew, vnew = torch.randn(b, hkv, d, generator=gen), torch.randn(b, hkv, d, generator=gen)
    lengths = torch.tensor([cap, 301])
    counts = torch.tensor([[5, 0, 650], [1, 300, 77]])
    positions = torch.zeros(b, hkv, cap, dtype=torch.int64)
    for r in range(b):
        for h in range(hkv):
            n = int(counts[r, h])
            positions[r, h, :n] = torch.randperm(int(lengths[r]), generator=gen)[:n]
    rows = kernels.KVRows.contiguous(k, v)
    out = kernels.attend_rows(rows, q, lengths, positions, counts, (knew, vnew), threads_=nthreads)
    every = kernels.attend_rows(rows, q, lengths, None, None, (knew, vnew), threads_=nthreads)
    for r in range(b):
        for h in range(hkv):
            n = int(counts[r, h])
            idx = positions[r, h, :n]
            kk = torch.cat([k[r, h, idx].float(), knew[r, h][None]])
            vv = torch.cat([v[r, h, idx].float(), vnew[r, h][None]])
            want = _dense(q[r, h], kk, vv, torch.ones(n + 1, dtype=torch.bool))
            torch.testing.assert_close(out[r, h].double(), want, rtol=2e-5, atol=2e-5)
            n = int(lengths[r])
            kk = torch.cat([k[r, h, :n].float(), knew[r, h][None]])
            vv = torch.cat([v[r, h, :n].float(), vnew[r, h][None]])
            want = _dense(q[r, h], kk, vv, torch.ones(n + 1, dtype=torch.bool))
            torch.testing.assert_close(every[r, h].double(), want, rtol=2e-5, atol=2e-5)


def test_attention_through_block_tables_reads_each_position_where_its_block_lies():
    gen = torch.Generator().manual_seed(2)
    blocks, hkv, bs, d, g = 12, 2, 16, 32, 3
    store = torch.randn(blocks, hkv, 2 * bs, d, generator=gen).to(torch.bfloat16)  # keys then values per block
    tables = torch.tensor([[7, 2, 9], [0, 11, 4]], dtype=torch.int32)
    lengths = torch.tensor([40, 33])
    q = torch.randn(2, hkv, g, d, generator=gen) * 0.3
    step = store.element_size()
    rows = kernels.KVRows(store.data_ptr(), store.data_ptr() + bs * d * step, tables.data_ptr(), 3, 0, 2 * bs * d,
                          hkv * 2 * bs * d, d, bs, kernels.KEY_FORMATS[torch.bfloat16])  # fmt: skip
    out = kernels.attend_rows(rows, q, lengths)
    for r in range(2):
        for h in range(hkv):
            n = int(lengths[r])
            blk = tables[r, torch.arange(n) // bs].long()
            k = store[blk, h, torch.arange(n) % bs].float()
            v = store[blk, h, bs + torch.arange(n) % bs].float()
            want = _dense(q[r, h], k, v, torch.ones(n, dtype=torch.bool))
            torch.testing.assert_close(out[r, h].double(), want, rtol=2e-5, atol=2e-5)
