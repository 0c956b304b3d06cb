"""Partial keys in 8 or 4 bits: InfiniGen's speculation state at a quarter or an eighth of its
16-bit size, scored without widening the cache.

The partial keys are the one part of InfiniGen that grows with the context and stays with the
compute. After the skew, their channels differ in scale by orders of magnitude (the skew moves
the energy into a few channels), each position differs in magnitude too, and some channels sit
far from zero (RoPE's slowest-turning pairs barely rotate over a context, so a key's offset there
is nearly the same at every position). So a key is stored as

    k[c, t] ~= mu[c] + sigma[c] * s[t] * code[c, t]

with `mu` one mean per channel and `sigma` one scale per channel (the mean and the root mean
square about it of that channel over the prompt, per batch row and KV head: measured on the
sequence itself, once, at its first append), `s` one scale per position (its largest
|(k - mu) / sigma| over the channels, / 127 or / 7, kept as float16) and `code` a signed integer
(int8, or 4 bits packed two channels per byte). Nothing is clipped: a later position larger than
the prompt's only gets a larger `s`. Without `mu`, an offset channel spends the codes' range on
its offset: 4-bit codes then lost a third of the ranking on source code. A score is then

    q . k ~= s[t] * sum_c (q[c] * sigma[c]) * code[c, t] + sum_c q[c] * mu[c]

so the selection kernel folds `sigma` into the query once per step, adds the last term once per
query head (`kernels.select` with `scales` and `bias`) and reads the codes as they are stored.
4-bit codes are scored with integer dot products: each query head (sigma folded in) is itself
quantized to int8 about its largest channel (`int8_query`), so that a score is
`s[t] * qscale * sum_c q8[c] * code[c, t]` in exact integers (`code_scores`: the tensor path, bit
for bit what the kernel computes on every instruction path); int8 codes are scored in float, and
`dequantize` is their tensor path's reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import infinigen.kernels as kernels
from infinigen.growing import GrowingTensor

LEVELS = {"int8": 127, "int4": 7}


@dataclass
class QuantizedPartialKeys:
    """One layer's partial keys as codes [B, Hkv, c (int8) or c/2 (int4, uint8), T] and scales
    [B, Hkv, 1, T] (float16), both channel-major and grown together, plus `mu` and `sigma`
    [B, Hkv, c] (float32)."""

    fmt: str
    codes: GrowingTensor = field(default_factory=lambda: GrowingTensor(dim=-1))
    scales: GrowingTensor = field(default_factory=lambda: GrowingTensor(dim=-1))
    sigma: torch.Tensor | None = None
    mu: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.codes.length

    def append(self, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """keys [B, Hkv, n, c] (projected partial keys, float32); valid [B, n] real tokens."""
        if self.mu is None:
            self.mu = channel_means(keys, valid)
        if self.sigma is not None and self._quantize_in_place(keys):
            return
        centered = keys.to(torch.float32) - self.mu[:, :, None, :]
        if self.sigma is None:
            self.sigma = channel_scales(centered, valid)
        codes, scales = quantize(centered, self.sigma, self.fmt)
        self.codes.append(codes)
        self.scales.append(scales)
        assert self.codes.full.shape[-1] == self.scales.full.shape[-1]  # one capacity: the kernel's one stride

    def _quantize_in_place(self, keys: torch.Tensor) -> bool:
        """A decode step's keys quantized by the kernel straight into the buffers (the same codes
        as `quantize`, in one call instead of a dozen tensor operations, each of which waits for
        the interpreter lock the prefetch thread shares); False where it cannot."""
        n, at = keys.shape[2], self.codes.length
        codes, scales = self.codes.claim(n), self.scales.claim(n)
        if kernels.quantize_keys(keys, self.mu, self.sigma, codes, scales, at):
            return True
        self.codes.length = self.scales.length = at  # nothing written: the tensor path appends
        return False

    def keys(self, length: int) -> torch.Tensor:
        """The first `length` positions dequantized, [B, Hkv, length, c] float32 (the reference)."""
        centered = dequantize(self.codes.data[..., :length], self.scales.data[..., :length], self.sigma, self.fmt)
        return centered + self.mu[:, :, None, :]

    def kernel_query(self, query: torch.Tensor) -> torch.Tensor:
        """query [B, H, c] (scaled partial queries) with sigma folded in, padded to an even channel
        count for int4: what the kernel multiplies the codes by."""
        b, h, c = query.shape
        hkv = self.sigma.shape[1]
        q = query.to(torch.float32).reshape(b, hkv, h // hkv, c) * self.sigma[:, :, None, :]
        if self.fmt == "int4" and c % 2:
            q = torch.nn.functional.pad(q, (0, 1))
        return q.reshape(b, h, -1)

    def scores(self, query: torch.Tensor, length: int) -> torch.Tensor:
        """Scaled partial queries [B, H, c] against the first `length` positions: [B, H, length]
        float32, as the selection kernel scores them (`code_scores` for 4-bit codes; for int8 codes
        the dequantized keys, the float path's reference)."""
        if self.fmt == "int4":
            return code_scores(
                self.codes.data, self.scales.data, self.kernel_query(query), self.kernel_bias(query), length
            )
        keys = self.keys(length)
        return torch.matmul(
            query.to(torch.float32).reshape(*keys.shape[:2], -1, keys.shape[-1]), keys.transpose(-1, -2)
        ).reshape(query.shape[0], query.shape[1], length)

    def kernel_bias(self, query: torch.Tensor) -> torch.Tensor:
        """[B, H]: each query head (scaled partial queries [B, H, c]) against the channel means,
        the part of every score the centered codes leave out."""
        b, h, c = query.shape
        hkv = self.mu.shape[1]
        q = query.to(torch.float32).reshape(b, hkv, h // hkv, c)
        return (q * self.mu[:, :, None, :]).sum(-1).reshape(b, h)


def int8_query(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., C] float32 -> (its int8 codes as float32 [..., C], its scale [...]): per head, scale =
    max|q| / 127 and code = round(q / scale), halves to even (all zero for a zero head)."""
    q = q.to(torch.float32)
    scale = q.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    codes = torch.where(scale[..., None] > 0, torch.round(q / safe), torch.zeros_like(q)).clamp(-127, 127)
    return codes, scale


def unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., C/2, T] uint8 -> each channel's stored nibble (code + 8) [..., C, T] float32."""
    low, high = (codes & 15).to(torch.float32), (codes >> 4).to(torch.float32)
    return torch.stack([low, high], dim=-2).reshape(*codes.shape[:-2], 2 * codes.shape[-2], codes.shape[-1])


def code_scores(
    codes: torch.Tensor, scales: torch.Tensor, query: torch.Tensor, bias: torch.Tensor | None, length: int
) -> torch.Tensor:
    """The scores of packed 4-bit codes [B, Hkv, C/2, >= length] with scales [B, Hkv, 1, >= length]
    against queries [B, H, C] (sigma folded in, scaled; C even) plus `bias` [B, H]: [B, H, length]
    float32, the integer dot products of `int8_query` finished as the kernel does
    ((dot - 8 * sum q8) * (s * qscale) + bias, each a float32 rounding)."""
    b, h, c = query.shape
    hkv = codes.shape[1]
    u = unpack_int4(codes[..., :length])[:, :, :c]  # [B, Hkv, C, T], exact small integers
    q8, qscale = int8_query(query)
    q8 = q8.reshape(b, hkv, h // hkv, c)
    dot = torch.matmul(q8, u)  # integers below 2^24: exact in float32 whatever the order
    centered = dot - 8 * q8.sum(-1, keepdim=True)
    s = scales[..., :length].to(torch.float32)  # [B, Hkv, 1, T]
    out = centered * (s * qscale.reshape(b, hkv, h // hkv, 1))
    if bias is not None:
        out = out + bias.to(torch.float32).reshape(b, hkv, h // hkv, 1)
    return out.reshape(b, h, length)


def _mean_over_real(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, c]: the mean of `x` [B, Hkv, n, c] over the real positions (`valid` [B, n]); 0 for
    a row without any."""
    w = valid.to(torch.float32)[:, None, :, None]  # [B, 1, n, 1]
    return (x * w).sum(2) / w.sum(2).clamp(min=1.0)


def channel_means(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """mu [B, Hkv, c]: each channel's mean over the real positions of `keys` [B, Hkv, n, c]; 0 for
    a row without any real position."""
    return _mean_over_real(keys.to(torch.float32), valid)


def channel_scales(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sigma [B, Hkv, c]: each channel's root mean square over the real positions of `keys`
    [B, Hkv, n, c], floored at 1e-6 of the row's largest (a silent channel must not divide by 0);
    1 for a row without any real position."""
    k = keys.to(torch.float32)
    rms = _mean_over_real(k * k, valid).sqrt()
    floor = rms.amax(-1, keepdim=True) * 1e-6
    sigma = torch.maximum(rms, floor)
    return torch.where(sigma > 0, sigma, torch.ones_like(sigma))


def quantize(keys: torch.Tensor, sigma: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [B, Hkv, n, c] -> (codes channel-major [B, Hkv, c or ceil(c/2), n], scales [B, Hkv, 1, n]
    float16). The codes are rounded against the float16 scale as stored, so dequantizing gives
    back what the kernel scores."""
    levels = LEVELS[fmt]
    x = keys.to(torch.float32) / sigma[:, :, None, :]
    scale = (x.abs().amax(-1) / levels).to(torch.float16)  # [B, Hkv, n]
    s = scale.to(torch.float32)
    codes = torch.round(x / torch.where(s > 0, s, torch.ones_like(s))[..., None]).clamp(-levels, levels)
    codes = codes.to(torch.int8).transpose(-1, -2)  # [B, Hkv, c, n]
    if fmt == "int4":
        if codes.shape[2] % 2:
            codes = torch.nn.functional.pad(codes, (0, 0, 0, 1))
        biased = (codes + 8).to(torch.uint8)
        codes = biased[:, :, 0::2] | (biased[:, :, 1::2] << 4)
    return codes.contiguous(), scale[:, :, None, :].contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, sigma: torch.Tensor, fmt: str) -> torch.Tensor:
    """The inverse of `quantize` up to rounding: [B, Hkv, n, c] float32."""
    c = sigma.shape[-1]
    if fmt == "int4":
        low = (codes & 15).to(torch.int8) - 8
        high = (codes >> 4).to(torch.int8) - 8
        codes = torch.stack([low, high], dim=3).reshape(*codes.shape[:2], -1, codes.shape[-1])[:, :, :c]
    x = codes.to(torch.float32) * scales.to(torch.float32)  # [B, Hkv, c, n]
    return x.transpose(-1, -2) * sigma[:, :, None, :]


def partial_bytes_per_position(fmt: str, channels: int, kv_itemsize: int) -> int:
    """Bytes one position of one KV head takes in the speculation state under `fmt`."""
    if fmt == "kv":
        return channels * kv_itemsize
    codes = channels if fmt == "int8" else (channels + 1) // 2
    return codes + 2  # + its float16 scale
