"""Int4 group-wise KV quantization and the int4 host-RAM tier, checked against brute-force loops."""

import pytest
import torch

from infinigen.storage import TransferStats
from infinigen.storage.int4 import (
    Int4RamTier,
    dequantize_int4,
    fake_quantize_int4,
    int4_group,
    int4_row_bytes,
    quantize_int4,
)


def _reference(x: torch.Tensor, group: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Element-by-element loops over groups: (codes [..., d], scale fp16, zero fp16, dequantized float32)."""
    d = x.shape[-1]
    g = min(group, d)
    rows = x.to(torch.float32).reshape(-1, d)
    codes = torch.zeros(rows.shape, dtype=torch.uint8)
    deq = torch.zeros(rows.shape, dtype=torch.float32)
    scales = torch.zeros(rows.shape[0], d // g, dtype=torch.float16)
    zeros = torch.zeros_like(scales)
    for r in range(rows.shape[0]):
        for gi in range(d // g):
            vals = [rows[r, c] for c in range(gi * g, (gi + 1) * g)]
            mn, mx = vals[0], vals[0]
            for v in vals:
                mn = v if v < mn else mn
                mx = v if v > mx else mx
            zero = mn.to(torch.float16)
            scale = ((mx - mn) / 15).to(torch.float16)
            if scale == 0:
                scale = torch.tensor(1.0, dtype=torch.float16)
            scales[r, gi], zeros[r, gi] = scale, zero
            for off, v in enumerate(vals):
                c = gi * g + off
                q = min(max(int(torch.round((v - zero.float()) / scale.float())), 0), 15)
                codes[r, c] = q
                deq[r, c] = torch.tensor(float(q), dtype=torch.float32) * scale.float() + zero.float()
    lead = x.shape[:-1]
    return (
        codes.reshape(*lead, d),
        scales.reshape(*lead, d // g),
        zeros.reshape(*lead, d // g),
        deq.reshape(*lead, d),
    )


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """Codes from packed bytes with explicit per-channel loops (even channel = low nibble)."""
    flat = packed.reshape(-1, packed.shape[-1])
    out = torch.zeros(flat.shape[0], flat.shape[1] * 2, dtype=torch.uint8)
    for r in range(flat.shape[0]):
        for i in range(flat.shape[1]):
            byte = int(flat[r, i])
            out[r, 2 * i] = byte & 0x0F
            out[r, 2 * i + 1] = byte >> 4
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@pytest.mark.parametrize("d", [64, 16])
def test_shapes_dtypes_and_layout(d):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, d) * 2
    packed, scale, zero = quantize_int4(x)
    g = min(64, d)
    assert int4_group(d) == g
    assert packed.shape == (2, 3, 4, d // 2) and packed.dtype == torch.uint8
    assert scale.shape == zero.shape == (2, 3, 4, d // g)
    assert scale.dtype == zero.dtype == torch.float16
    codes, ref_scale, ref_zero, _ = _reference(x)
    assert torch.equal(_unpack(packed), codes)
    assert torch.equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))
    assert torch.equal(scale, ref_scale) and torch.equal(zero, ref_zero)
    assert int(codes.max()) <= 15 and int(codes.min()) >= 0
    assert dequantize_int4(packed, scale, zero).shape == x.shape


def test_nibble_order_on_a_known_row():
    # One group of 16 channels 0..15: min 0, scale 1, so channel c gets code c.
    x = torch.arange(16, dtype=torch.float32)
    packed, scale, zero = quantize_int4(x)
    assert scale.tolist() == [1.0] and zero.tolist() == [0.0]
    assert packed.tolist() == [c | ((c + 1) << 4) for c in range(0, 16, 2)]
    assert torch.equal(dequantize_int4(packed, scale, zero), x)


@pytest.mark.parametrize("d", [64, 16, 128])
def test_error_within_half_a_step(d):
    torch.manual_seed(1)
    x = torch.randn(3, 5, d) * 3 + 0.5
    packed, scale, zero = quantize_int4(x)
    g = min(64, d)
    err = (dequantize_int4(packed, scale, zero) - x).abs()
    bound = scale.float().repeat_interleave(g, dim=-1) / 2 + 1e-6
    assert bool((err <= bound).all())


def test_constant_group_is_exact():
    # Values representable in fp16, so the stored zero is the value itself.
    x = torch.full((2, 64), 1.25)
    x[1] = -3.5
    packed, scale, zero = quantize_int4(x)
    assert bool((packed == 0).all())
    assert scale.tolist() == [[1.0], [1.0]]
    assert torch.equal(dequantize_int4(packed, scale, zero), x)
    # One constant group next to a varying one.
    torch.manual_seed(2)
    y = torch.cat([torch.full((64,), 0.75), torch.randn(64)])
    out = fake_quantize_int4(y)
    assert torch.equal(out[:64], y[:64])


@pytest.mark.parametrize("shape", [(2, 3, 7, 64), (4, 16), (2, 5, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_brute_force_reproduces_dequantize_exactly(shape, dtype):
    torch.manual_seed(3)
    x = (torch.randn(shape) * 4).to(dtype)
    _, _, _, ref = _reference(x)
    assert torch.equal(dequantize_int4(*quantize_int4(x)), ref)
    out = fake_quantize_int4(x)
    assert out.dtype == dtype and torch.equal(out, ref.to(dtype))


def test_bad_head_dims():
    with pytest.raises(ValueError, match="divisible"):
        int4_group(96)
    with pytest.raises(ValueError, match="divisible"):
        quantize_int4(torch.randn(2, 96))
    with pytest.raises(ValueError, match="even"):
        quantize_int4(torch.randn(2, 15))
    with pytest.raises(ValueError, match="divisible"):
        int4_row_bytes(96)
    with pytest.raises(ValueError, match="divisible"):
        Int4RamTier(1, 1, 96, torch.float32, TransferStats())
    assert int4_group(96, group=32) == 32


def test_row_bytes():
    assert int4_row_bytes(64) == 72
    assert int4_row_bytes(128) == 2 * (64 + 4 * 2)
    assert int4_row_bytes(16) == 2 * (8 + 4)
    assert Int4RamTier(1, 1, 64, torch.float16, TransferStats()).row_bytes == 72


def _filled_tier(dtype: torch.dtype = torch.float32) -> tuple[Int4RamTier, torch.Tensor, torch.Tensor, TransferStats]:
    torch.manual_seed(4)
    b, h, d = 2, 3, 64
    k1, v1 = torch.randn(b, h, 5, d).to(dtype), torch.randn(b, h, 5, d).to(dtype)
    k2, v2 = (
        torch.randn(b, h, 300, d).to(dtype),
        torch.randn(b, h, 300, d).to(dtype),
    )  # past the first room (64 positions): grows
    stats = TransferStats()
    tier = Int4RamTier(b, h, d, dtype, stats)
    tier.append(k1, v1)
    tier.append(k2, v2)
    return tier, torch.cat([k1, k2], dim=2), torch.cat([v1, v2], dim=2), stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tier_read_all_matches_fake_quantize(dtype):
    tier, k, v, stats = _filled_tier(dtype)
    assert tier.length == 305
    rk, rv = tier.read_all(305, torch.device("cpu"), dtype)
    assert rk.dtype == dtype
    assert torch.equal(rk, fake_quantize_int4(k)) and torch.equal(rv, fake_quantize_int4(v))
    assert stats.bytes == 2 * 3 * 305 * 72 and stats.rows == 2 * 3 * 305 and stats.requests == 1
    pk, pv = tier.peek_all()
    assert pk.dtype == torch.float32
    assert torch.equal(pk, fake_quantize_int4(k.float())) and torch.equal(pv, fake_quantize_int4(v.float()))
    assert stats.requests == 1  # peek is not counted
    part, _ = tier.read_all(7, torch.device("cpu"), torch.float32)
    assert torch.equal(part, fake_quantize_int4(k.float())[:, :, :7])
    assert stats.bytes == 2 * 3 * (305 + 7) * 72 and stats.requests == 2
    mid, _ = tier.read_range_async(3, 260, torch.device("cpu"), torch.float32).result()
    assert torch.equal(mid, fake_quantize_int4(k.float())[:, :, 3:260])
    assert stats.bytes == 2 * 3 * (305 + 7 + 257) * 72 and stats.requests == 3


def test_tier_gather_matches_rows_and_counts_valid_only():
    tier, k, v, stats = _filled_tier()
    fk, fv = fake_quantize_int4(k), fake_quantize_int4(v)
    torch.manual_seed(5)
    idx = torch.randint(0, 305, (2, 3, 9))
    valid = torch.rand(2, 3, 9) > 0.3
    valid[0, 0, 0] = False
    gk, gv = tier.gather(idx, valid, torch.device("cpu"), torch.float32)
    assert gk.shape == (2, 3, 9, 64)
    for b in range(2):
        for h in range(3):
            for s in range(9):
                want_k = fk[b, h, idx[b, h, s]] if valid[b, h, s] else torch.zeros(64)
                want_v = fv[b, h, idx[b, h, s]] if valid[b, h, s] else torch.zeros(64)
                assert torch.equal(gk[b, h, s], want_k) and torch.equal(gv[b, h, s], want_v)
    n_valid = int(valid.sum())
    assert stats.bytes == n_valid * 72 and stats.rows == n_valid and stats.requests == 1


def test_tier_errors():
    tier, _, _, _ = _filled_tier()
    idx = torch.tensor([[[0, 305]] * 3] * 2)
    with pytest.raises(IndexError, match="305"):
        tier.gather(idx, torch.ones_like(idx, dtype=torch.bool), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="tier holds"):
        tier.append(torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64))
    with pytest.raises(ValueError, match="tier holds"):
        tier.append(torch.randn(2, 3, 1, 32), torch.randn(2, 3, 1, 32))


def test_the_tier_grows_by_the_one_growth_rule():
    """Room for at least 64 positions, then a quarter more each time it fills (`grown_size`),
    not double: the room beyond what is held stays small."""
    from infinigen.growing import grown_size

    tier = Int4RamTier(1, 2, 64, torch.float16, TransferStats())
    assert tier.stored_bytes() == 0  # nothing allocated before the first append
    room, rows = 0, 2 * tier.row_bytes  # bytes of one position of both KV heads
    for n in (5, 100, 1, 1, 50):
        if tier.length + n > room:
            room = grown_size(room, tier.length + n)
        tier.append(torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64))
        assert tier.stored_bytes() == room * rows
