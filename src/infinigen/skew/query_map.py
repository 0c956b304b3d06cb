"""The previous layer's query map: layer i's query projection refitted to layer i-1's input.

InfiniGen speculates layer i's attention one layer ahead, from layer i-1's normalized input
x_{i-1} through layer i's own projection W_q. What separates x_{i-1} from layer i's true input
x_i (layer i-1's attention and MLP output, and a different norm weight) is the largest source
of the speculation's error left (docs/CHANGELOG.md, commit a1ece90). Part of it is
linear and the same on every text: calibration fits, per layer, the affine map M that best
predicts layer i's query projection from x_{i-1},

    M = argmin ||[x_{i-1}, 1] M - q_proj_i(x_i)||² + λ·s·||M - [W_qᵀ; b_q]||²,

ridge-regularized toward the layer's own projection (s: the mean diagonal of x_{i-1}ᵀx_{i-1},
so λ does not depend on the activations' scale; λ → ∞ gives back plain InfiniGen). At decode
the speculated query is `query_heads(x_{i-1} M)`: the same cost as `q_proj`, and the same
per-head norm and RoPE after it.
"""

from __future__ import annotations

import torch
from torch import nn

QUERY_MAP_RIDGE = 0.1  # λ: chosen on the essays (docs/CHANGELOG.md, commit a1ece90)
QUERY_MAP_DTYPE = torch.float16  # as stored in the artifact; applied in float32


def project_queries(q_proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] through the layer's query projection as the model computes it, in the
    projection's own dtype, then in float32 -> [B, T, H·d]: the speculation goes on in float32
    from the very query the model forms. A float32 copy of a 16-bit model's weights would cost
    their size again, or a conversion at every step (several times the projection itself on a CPU)."""
    dtype = next((p.dtype for p in q_proj.parameters() if p.is_floating_point()), x.dtype)
    return q_proj(x.to(dtype)).to(torch.float32)


def own_projection(q_proj: torch.nn.Linear) -> torch.Tensor:
    """[D + 1, H·d]: the layer's own query projection as an affine map (bias row last)."""
    w = q_proj.weight.detach().to(torch.float64).T
    b = q_proj.bias.detach().to(torch.float64) if q_proj.bias is not None else torch.zeros(w.shape[1], dtype=w.dtype)
    return torch.cat([w, b[None]], 0)


def fit_query_map(
    previous: torch.Tensor, target: torch.Tensor, own: torch.Tensor, ridge: float = QUERY_MAP_RIDGE
) -> torch.Tensor:
    """The ridge fit above: previous [T, D] (layer i-1's normalized input), target [T, H·d]
    (layer i's query projection of its own input), own [D + 1, H·d] (`own_projection`)
    -> [D + 1, H·d] (float32)."""
    if ridge < 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")
    x = previous.to(torch.float32)
    x1 = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], 1)
    # the products in float32 (T·D² work), the solve in float64 (the ridge keeps it well posed)
    gram = (x1.T @ x1).to(torch.float64)
    s = float(gram.diagonal()[:-1].mean()) if x.shape[1] else 1.0
    own = own.to(torch.float64).to(x.device)
    lhs = gram + ridge * s * torch.eye(gram.shape[0], dtype=gram.dtype, device=x.device)
    rhs = (x1.T @ target.to(torch.float32)).to(torch.float64) + ridge * s * own
    return torch.linalg.solve(lhs, rhs).to(torch.float32)


def apply_query_map(x: torch.Tensor, query_map: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] through the affine map [D + 1, H·d] -> [B, T, H·d] (float32)."""
    m = query_map.to(torch.float32)
    return torch.addmm(m[-1], x.reshape(-1, x.shape[-1]).to(torch.float32), m[:-1]).view(*x.shape[:-1], m.shape[1])


def fold_skew_into_map(query_map: torch.Tensor, skew: torch.Tensor, num_heads: int) -> torch.Tensor:
    """For a model whose skew is folded into W_q (no RoPE): the map's per-head output columns
    times that head's group skew A [Hkv, d, d], as `fold_skew` does to W_q."""
    d = skew.shape[-1]
    group = num_heads // skew.shape[0]
    m = query_map.to(torch.float32).view(query_map.shape[0], num_heads, d)
    a = skew.to(torch.float32).repeat_interleave(group, 0)  # [H, d, d]
    return torch.einsum("rhd,hde->rhe", m, a).reshape(query_map.shape[0], num_heads * d)
