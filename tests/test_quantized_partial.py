"""Partial keys in int8 / int4 (`partial_format`): what they store, that the kernel scores the codes
exactly as the dequantized reference does, and that decoding through them selects like 16-bit."""

from __future__ import annotations

import math
import os

import pytest
import torch

from conftest import VOCAB, tiny_model
from infinigen import InfiniGenConfig, attach, kernels
from infinigen.compat import cache_kwargs
from infinigen.config import ConfigError
from infinigen.select.quantized import LEVELS, QuantizedPartialKeys, channel_scales, code_scores, dequantize, quantize
from infinigen.speculate import aggregate_group, partial_scores, select_positions, top_up

FORMATS = ["int8", "int4"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("c", [5, 8])
def test_quantization_error_is_within_half_a_step_of_each_position(fmt, c):
    gen = torch.Generator().manual_seed(0)
    spread = torch.logspace(-2, 1, c)  # channels whose scales differ by 1000x, as after the skew
    keys = torch.randn(2, 3, 50, c, generator=gen) * spread
    valid = torch.ones(2, 50, dtype=torch.bool)
    sigma = channel_scales(keys, valid)
    codes, scales = quantize(keys, sigma, fmt)
    assert codes.dtype == (torch.int8 if fmt == "int8" else torch.uint8)
    assert codes.shape == (2, 3, c if fmt == "int8" else math.ceil(c / 2), 50) and scales.shape == (2, 3, 1, 50)
    back = dequantize(codes, scales, sigma, fmt)
    step = scales.float().transpose(-1, -2) * sigma[:, :, None, :]  # [B, Hkv, n, c]
    assert ((back - keys).abs() <= 0.5 * step * (1 + 1e-3) + 1e-7).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_later_position_larger_than_the_prompt_is_not_clipped(fmt):
    gen = torch.Generator().manual_seed(1)
    state = QuantizedPartialKeys(fmt)
    state.append(torch.randn(1, 1, 20, 6, generator=gen), torch.ones(1, 20, dtype=torch.bool))
    big = torch.randn(1, 1, 1, 6, generator=gen) * 1000
    state.append(big, torch.ones(1, 1, dtype=torch.bool))
    got = state.keys(21)[:, :, 20]
    assert (got - big[:, :, 0]).abs().max() <= big.abs().max() / LEVELS[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_channel_far_from_zero_keeps_the_resolution_of_its_spread(fmt):
    """A channel offset by 50x its spread (as RoPE's slowest pairs are) is stored about its mean:
    its error is bounded by its spread's step, not by a step of the offset's size."""
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 2, 64, 6, generator=gen)
    keys[..., 0] += 50.0
    valid = torch.ones(1, 64, dtype=torch.bool)
    state = QuantizedPartialKeys(fmt)
    state.append(keys, valid)
    err = (state.keys(64) - keys).abs().amax()
    spread = (keys - keys.mean(2, keepdim=True)).abs().amax()
    assert err <= 0.5 * spread / LEVELS[fmt] * 1.01 * keys.shape[-1] ** 0.5
    assert torch.allclose(state.mu[..., 0], keys[..., 0].mean(2), atol=1e-4)


def test_channel_scales_ignore_padding_and_survive_silent_channels():
    keys = torch.ones(1, 1, 4, 3)
    keys[..., 2] = 0.0  # a silent channel
    keys[:, :, :2] = 1000.0  # padding positions, not to be counted
    valid = torch.tensor([[False, False, True, True]])
    sigma = channel_scales(keys, valid)
    assert torch.allclose(sigma[0, 0, :2], torch.ones(2)) and 0 < sigma[0, 0, 2] <= 1e-6


def _exact_case(seed: int, fmt: str, b=2, hkv=2, g=3, c=6, t=300):
    """Codes, power-of-two scales and integer queries: every product and sum is exact in float32,
    so the kernel and the dequantized reference must agree bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    levels = LEVELS[fmt]
    codes = torch.randint(-levels, levels + 1, (b, hkv, c, t), generator=gen).to(torch.int8)
    scales = (2.0 ** torch.randint(-3, 3, (b, hkv, 1, t), generator=gen)).to(torch.float16)
    sigma = 2.0 ** torch.randint(-2, 3, (b, hkv, c), generator=gen).float()
    mu = torch.randint(-4, 5, (b, hkv, c), generator=gen).float()  # centered codes: a mean per channel
    query = torch.randint(-2, 3, (b, hkv * g, c), generator=gen).float()
    valid = torch.ones(b, hkv, t, dtype=torch.bool)
    valid[1, :, : t // 4] = False
    if fmt == "int4":
        biased = (codes + 8).to(torch.uint8)
        stored = biased[:, :, 0::2] | (biased[:, :, 1::2] << 4)
    else:
        stored = codes
    keys = dequantize(stored, scales, sigma, fmt) + mu[:, :, None, :]  # [B, Hkv, t, c]
    state = QuantizedPartialKeys(fmt, sigma=sigma, mu=mu)
    return stored.contiguous(), scales, state.kernel_query(query), state.kernel_bias(query), keys, query, valid


@pytest.fixture
def _kernel():
    if not kernels.available():
        if os.environ.get("CI"):
            pytest.fail("the C selection kernel must build on CI (a C compiler is installed)")
        pytest.skip("no C compiler: the kernel is unavailable here")


@pytest.mark.usefixtures("_kernel")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("agg", ["max", "union", "sum"])
@pytest.mark.parametrize("budget", [0.05, 0.3, 1.0])
def test_kernel_scores_the_codes_as_their_tensor_path(fmt, agg, budget):
    for seed in range(3):
        stored, scales, kq, bias, keys, query, valid = _exact_case(seed, fmt)
        t = keys.shape[2]
        # 4-bit codes are scored in integers against the int8 query (their tensor path, `code_scores`);
        # int8 codes in float, as the dequantized keys
        s = code_scores(stored, scales, kq, bias, t) if fmt == "int4" else partial_scores(query, keys, 1.0)
        g = aggregate_group(s, valid, keys.shape[1], agg)
        ref = select_positions(g, valid, math.inf, budget, None, 1)
        idx, counts = kernels.select(stored, t, kq, valid, agg, math.inf, budget, None, 1, scales=scales, bias=bias)
        assert torch.equal(counts, ref.counts)
        slots = torch.arange(idx.shape[-1]) < counts[..., None]
        assert torch.equal(torch.where(slots, idx, 0), ref.indices)
        chosen = torch.zeros_like(valid)
        count = torch.full(valid.shape[:2], 7)
        want = top_up(g, valid, chosen, count)
        got = kernels.top_up(stored, t, kq, valid, agg, chosen, count, scales=scales, bias=bias)
        assert torch.equal(got[1], want.counts) and torch.equal(got[0], want.indices)


@pytest.mark.usefixtures("_kernel")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("c", [1, 7, 40])
def test_kernel_quantizes_new_keys_bit_for_bit_as_the_tensor_path(fmt, c):
    """Codes and float16 scales written in place by the kernel equal `quantize`'s, including
    scales that round to float16 subnormals, to its largest values, past it to infinity (every
    code 0), and a row of zeros; columns beside the written ones are left alone."""
    torch.manual_seed(c)
    b, hkv, n, cap, at = 2, 3, 5, 16, 9
    keys = torch.randn(b, hkv, n, c)
    keys[0, 0] *= 1e-7  # scales far below float16's normals
    keys[0, 1] *= 3e-5  # around its smallest normal
    keys[0, 2] *= 1e6  # up to and past its largest value
    keys[1, 0, 0] = 0.0
    ties = [float(LEVELS[fmt]), 0.5, 1.5, 2.5, -2.5, 3.5, -0.5]  # a scale of exactly 1: codes at x.5
    keys[1, 1] = torch.tensor((ties * c)[:c])[None]
    mu = torch.zeros(b, hkv, c)
    mu[1, 2] = torch.randn(c)
    sigma = torch.rand(b, hkv, c) + 0.5
    sigma[0, 2] = 1e-3
    sigma[1, 1] = 1.0
    want_codes, want_scales = quantize(keys - mu[:, :, None, :], sigma, fmt)
    rows = c if fmt == "int8" else (c + 1) // 2
    codes = torch.full((b, hkv, rows, cap), 0x55, dtype=want_codes.dtype)
    scales = torch.full((b, hkv, 1, cap), 0.25, dtype=torch.float16)
    assert kernels.quantize_keys(keys, mu, sigma, codes, scales, at)
    assert torch.equal(codes[..., at : at + n], want_codes)
    assert torch.equal(scales[..., at : at + n].view(torch.int16), want_scales.view(torch.int16))
    assert (codes[..., :at] == 0x55).all() and (scales[..., :at] == 0.25).all()
    assert torch.isinf(want_scales).any() and (want_scales.float().abs() < 6.1e-5).any()
    if c > 4:
        assert want_codes.dtype != torch.int8 or want_codes[1, 1, 1:5, 0].tolist() == [0, 2, 2, -2]
    assert not kernels.quantize_keys(keys.double(), mu, sigma, codes, scales, at)  # not a format it reads
    assert not kernels.quantize_keys(keys, mu, sigma, codes, scales, cap - 1)  # no room


@pytest.mark.usefixtures("_kernel")
def test_kernel_refuses_codes_without_matching_scales():
    stored, scales, kq, bias, *_ = _exact_case(0, "int8")
    with pytest.raises(ValueError, match="scales"):
        kernels.select(stored, 10, kq, None, "max", 1.0, 1.0, None, 1, scales=scales.float())
    with pytest.raises(ValueError, match="channels"):
        kernels.select(stored, 10, kq[..., :-1], None, "max", 1.0, 1.0, None, 1, scales=scales)
    with pytest.raises(ValueError, match="one per query head"):
        kernels.select(stored, 10, kq, None, "max", 1.0, 1.0, None, 1, scales=scales, bias=bias[:, :-1])


def _decode(cfg: InfiniGenConfig, new: int = 12):
    ids = torch.randint(3, VOCAB, (2, 160), generator=torch.Generator().manual_seed(11))
    model = tiny_model("llama")
    with attach(model, cfg, progress=False) as session, session.new_cache() as cache:
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), max_new_tokens=new,
            do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        return out.sequences, torch.stack(out.logits), cache.summary()


@pytest.mark.usefixtures("_kernel")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("correction, block", [(0.0, 1), (0.05, 1), (0.05, 4)])
def test_decode_through_the_kernel_equals_the_tensor_path(fmt, correction, block, monkeypatch):
    """Positions, or aligned blocks of them (`block_tokens`), with and without a correction."""
    cfg = InfiniGenConfig(budget=0.1, calibration_tokens=64, kv_dtype="float16", correction=correction,
                          partial_format=fmt, block_tokens=block)  # fmt: skip
    runs = []
    for enabled in ("1", "0"):
        monkeypatch.setenv("INFINIGEN_KERNELS", enabled)
        runs.append(_decode(cfg))
    (seq_c, logits_c, s_c), (seq_t, logits_t, s_t) = runs
    assert torch.equal(seq_c, seq_t) and s_c["selector_bytes"] == s_t["selector_bytes"]
    torch.testing.assert_close(logits_c, logits_t, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt, most", [("int8", 0.5 + 1 / 12), ("int4", 0.25 + 1 / 12)])
def test_quantized_partial_keys_hold_a_fraction_of_16_bit_and_select_alike(fmt, most):
    """Bytes: codes plus a float16 scale per position, against c 16-bit channels (c = 12 here).
    Selection: most positions chosen from int8 / int4 keys are those 16-bit keys choose."""
    base = InfiniGenConfig(
        budget=0.25, calibration_tokens=64, kv_dtype="float16", partial_ratio=0.75, partial_format="kv"
    )
    seq16, logits16, s16 = _decode(base, new=6)
    seq_q, logits_q, s_q = _decode(base.replace(partial_format=fmt), new=6)
    assert s_q["selector_bytes"] <= most * s16["selector_bytes"] * 1.06  # + mu and sigma per row (a short context)
    assert s_q["fetched_fraction"] == pytest.approx(s16["fetched_fraction"], rel=1e-6)
    p16, pq = torch.softmax(logits16, -1), torch.log_softmax(logits_q, -1)
    kl = (p16 * (torch.log(p16) - pq)).sum(-1).mean()
    assert float(kl) < 0.05


def test_an_unknown_partial_format_is_refused():
    with pytest.raises(ConfigError, match="partial_format"):
        InfiniGenConfig(partial_format="int2")
