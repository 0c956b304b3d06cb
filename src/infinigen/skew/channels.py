"""Skew and partial channels of one layer from its calibration queries and keys.

For each KV head, stack the (post-RoPE) queries of the heads in its group and take the right
singular vectors A of that matrix (eigenvectors of QᵀQ). A is orthogonal, so (qA)(kA)ᵀ = qkᵀ, but
a few columns of qA now carry most of the magnitude; the partial channels are the r·d columns of
largest summed |qA| + |kA|.
"""

from __future__ import annotations

import torch

from infinigen.speculate import channel_count


def skew_from_qk(
    q: torch.Tensor, k: torch.Tensor, num_kv_heads: int, ratio: float, skewed: bool, with_order: bool = False
):
    """Skew and channels of one layer. q: [H, T, d]; k: [Hkv, T, d]. `with_order`: also every
    channel ranked by the same mass, largest first ([Hkv, d]; its top-c prefix is the choice of
    c channels, which per-layer channel counts take)."""
    h, t, d = q.shape
    group = h // num_kv_heads
    c = channel_count(ratio, d)
    skews, chans, orders = [], [], []
    for g in range(num_kv_heads):
        qg = q[g * group : (g + 1) * group].reshape(-1, d).to(torch.float64)  # group queries stacked
        kg = k[g].to(torch.float64)
        if skewed:
            _, _, vh = torch.linalg.svd(qg, full_matrices=False)
            a = vh.transpose(0, 1)  # columns: right singular vectors, largest first
        else:
            a = torch.eye(d, dtype=torch.float64)
        mass = (qg @ a).abs().sum(0) + (kg @ a).abs().sum(0)
        chans.append(torch.topk(mass, c).indices.sort().values)
        skews.append(a.to(torch.float32))
        if with_order:
            orders.append(torch.argsort(mass, descending=True, stable=True))
    if with_order:
        return torch.stack(skews), torch.stack(chans).to(torch.long), torch.stack(orders).to(torch.long)
    return torch.stack(skews), torch.stack(chans).to(torch.long)


def query_mass_in_channels(q: torch.Tensor, skew: torch.Tensor | None, channels: torch.Tensor) -> float:
    """Fraction of Σ q² held by `channels` after the skew (q: [H, T, d], GQA-grouped)."""
    hkv = channels.shape[0]
    group = q.shape[0] // hkv
    kept, total = 0.0, 0.0
    for g in range(hkv):
        qg = q[g * group : (g + 1) * group].reshape(-1, q.shape[-1]).to(torch.float64)
        if skew is not None:
            qg = qg @ skew[g].to(torch.float64)
        sq = qg.pow(2)
        kept += sq[:, channels[g]].sum().item()
        total += sq.sum().item()
    return kept / total
