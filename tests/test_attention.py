"""Attention over stored rows (`attention.attend_stored`): 16-bit rows widened a slice at a time
give what one fp64 softmax over the widened rows and the step's own position gives."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import VOCAB, left_padded_batch, tiny_model
from infinigen import InfiniGenConfig, attach, attention, kernels
from infinigen.attention import attend_stored, widen_rows
from infinigen.compat import cache_kwargs
from infinigen.layers import ComputeLayer


def _reference(query, rows, valid, new, scaling):
    """Softmax in float64 over every row (widened as stored) and the new position, last."""
    b, h, _, d = query.shape
    hkv = rows[0].shape[1]
    q = query.reshape(b, hkv, h // hkv, d).double()
    k = torch.cat([rows[0].double(), new[0].double()], 2)
    v = torch.cat([rows[1].double(), new[1].double()], 2)
    ok = torch.cat([valid, valid.new_ones(b, hkv, 1)], -1)
    scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~ok[:, :, None, :], -math.inf)
    probs = torch.softmax(scores, -1)
    return (probs @ v).reshape(b, 1, h, d), probs.reshape(b, h, 1, -1)


def _use(path: str, monkeypatch) -> None:
    """Attend through the C kernel ("c") or the tensor operations ("torch")."""
    if path == "c" and not kernels.available():
        pytest.skip("no C compiler: the kernel path cannot run here")
    monkeypatch.setenv("INFINIGEN_KERNELS", "1" if path == "c" else "0")


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("widen_bytes", [1, 3000, 1 << 30])  # one row a slice, a few rows, all at once
@pytest.mark.parametrize("n", [37, 0])  # rows a tile and a ragged one; no row (the new position alone)
def test_stored_rows_attended_a_slice_at_a_time_equal_one_softmax(path, dtype, widen_bytes, n, monkeypatch):
    _use(path, monkeypatch)
    monkeypatch.setattr(attention, "WIDEN_BYTES", widen_bytes)
    g = torch.Generator().manual_seed(0)
    b, h, hkv, d = 2, 6, 2, 16
    query = torch.randn(b, h, 1, d, generator=g)
    room = torch.randn(2, b, hkv, n + 5, d, generator=g).to(dtype)  # buffers with room beyond the rows
    rows = (room[0][:, :, :n], room[1][:, :, :n])
    valid = torch.rand(b, hkv, n, generator=g) > 0.3  # ragged: unused slots hold stale rows
    valid[1, 0] = False  # one (batch, KV head) with no row to attend but its own position
    new = (torch.randn(b, hkv, 1, d, generator=g), torch.randn(b, hkv, 1, d, generator=g))
    out, probs = attend_stored(query, rows, valid, new, 0.25, weights=True)
    want_out, want_probs = _reference(query, rows, valid, new, 0.25)
    assert out.dtype == query.dtype and out.shape == (b, 1, h, d)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.double(), want_probs, rtol=1e-5, atol=1e-7)
    assert probs[..., :n].masked_select(~valid.repeat_interleave(h // hkv, 1)[:, :, None, :]).eq(0).all()
    assert attend_stored(query, rows, valid, new, 0.25)[1] is None  # no weights unless asked


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("layout", ["all valid", "head dim not a multiple of 8", "keys and values apart"])
def test_stored_rows_in_every_layout_equal_one_softmax(path, layout, monkeypatch):
    """Every row valid (no mask read), a head dim the kernel does not take, and keys and values
    with different strides (the kernel declines both: the tensor path attends them)."""
    _use(path, monkeypatch)
    g = torch.Generator().manual_seed(1)
    b, h, hkv, n, d = 3, 8, 2, 70, 12 if layout == "head dim not a multiple of 8" else 32
    query = torch.randn(b, h, 1, d, generator=g)
    keys = torch.randn(b, hkv, n, d, generator=g).half()
    values = torch.randn(b, hkv, n + 9, d, generator=g).half()[:, :, :n]
    if layout != "keys and values apart":
        values = values.contiguous()
    assert kernels.can_attend((keys, values)) == (path == "c" and layout == "all valid")
    valid = torch.ones(b, hkv, n, dtype=torch.bool)
    new = (torch.randn(b, hkv, 1, d, generator=g), torch.randn(b, hkv, 1, d, generator=g))
    out, probs = attend_stored(query, (keys, values), valid, new, d**-0.5, weights=True)
    want_out, want_probs = _reference(query, (keys, values), valid, new, d**-0.5)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.double(), want_probs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("cuts", [(), (1,), (9, 30), (5, 6, 7)])  # whole, a one-row part, ragged, many
def test_rows_attended_in_parts_and_merged_equal_one_softmax(path, dtype, cuts, monkeypatch):
    """A layer read in chunks attends each as it lands (`attend_part`) and merges it into the
    softmax carried from its own position (`own_part`, `merge`): the same output as one fp64
    softmax over every row, with masked rows and a part where a row has nothing valid."""
    _use(path, monkeypatch)
    g = torch.Generator().manual_seed(2)
    b, h, hkv, n, d = 2, 6, 2, 37, 16
    query = torch.randn(b, h, 1, d, generator=g)
    room = torch.randn(2, b, hkv, n + 5, d, generator=g).to(dtype)
    rows = (room[0][:, :, :n], room[1][:, :, :n])
    valid = torch.rand(b, hkv, n, generator=g) > 0.3
    valid[1, 0] = False  # one (batch, KV head) with no row to attend but its own position
    new = (torch.randn(b, hkv, 1, d, generator=g), torch.randn(b, hkv, 1, d, generator=g))
    q = query.reshape(b, hkv, h // hkv, d) * 0.25
    carried = attention.own_part(q, *new)
    for start, stop in zip((0, *cuts), (*cuts, n)):
        part = attention.attend_part(q, (rows[0][:, :, start:stop], rows[1][:, :, start:stop]), valid[..., start:stop])
        empty = ~valid[..., start:stop].any(-1)  # [B, Hkv]: nothing to attend in this part
        assert part.lse[empty].eq(-math.inf).all() and part.out[empty].eq(0).all()
        assert torch.isfinite(part.lse[~empty]).all()
        carried = attention.merge(carried, part)
    want, _ = _reference(query, rows, valid, new, 0.25)
    torch.testing.assert_close(carried.out.reshape(b, 1, h, d).double(), want, rtol=1e-5, atol=1e-6)


def test_the_slices_are_bounded_and_fp32_rows_are_not_copied():
    rows16 = torch.zeros(8, 3, 1000, 64, dtype=torch.float16)
    step = widen_rows(rows16)
    assert step * 8 * 3 * 64 * 4 <= attention.WIDEN_BYTES < (step + 1) * 8 * 3 * 64 * 4
    assert widen_rows(rows16.float()) == 1000  # fp32 rows are attended in place, in one slice


@pytest.mark.parametrize("padded", [False, True])
def test_dense_layers_kept_in_16_bits_are_attended_as_stored_at_a_decode_step(padded, monkeypatch):
    """A session's decode step hands a 16-bit dense layer's attention the past as stored (no fp32
    copy of the layer), and decodes what the same layer widened whole gives (its mask honoured:
    left padding is never attended)."""
    seen: list[tuple[int, torch.dtype]] = []
    attend = ComputeLayer.attend

    def spy(self, module, query, key, value, *args, **kwargs):
        seen.append((query.shape[2], key.dtype))
        return attend(self, module, query, key, value, *args, **kwargs)

    model = tiny_model("llama")
    ids, mask = left_padded_batch() if padded else (torch.randint(3, VOCAB, (2, 24)), None)
    cfg = InfiniGenConfig(policy="dense", kv_dtype="float16")

    def run():
        with attach(model, cfg, progress=False) as session:
            cache = session.new_cache()
            return model.generate(
                input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=5, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip

    monkeypatch.setattr(ComputeLayer, "own_input", lambda self, x, pe: None)  # no step marked: ...
    widened = run()  # ... the reference, every call widening the whole past
    monkeypatch.undo()
    monkeypatch.setattr(ComputeLayer, "attend", spy)
    stored = run()
    assert {dt for q, dt in seen if q == 1} == {torch.float16} and {dt for q, dt in seen if q > 1} == {torch.float32}
    assert torch.equal(stored.sequences, widened.sequences)
    for a, b in zip(stored.logits, widened.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
