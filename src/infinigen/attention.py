"""The attention function a session registers, and the math of attending over a selection.

The session's pre-hook hands each attention call the cache layer it belongs to (the
``infinigen_layer`` keyword, passed through the model's own ``**kwargs``); that layer decides
how to attend. Without one (a plain cache inside a session) this is ordinary sdpa attention.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "infinigen"


def infinigen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    infinigen_layer=None,
    **kwargs,
):
    """query [B, H, q, d]; key, value: what the layer's `update` returned [B, Hkv, k, d]."""
    if infinigen_layer is None:
        return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return infinigen_layer.attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def dense_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The model's own attention (sdpa) over every key it is given."""
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def attention_scaling(query: torch.Tensor, scaling: float | None) -> float:
    """The scale of the scores: the model's own when it passes one, else 1/sqrt(head dim) (the
    default every attention implementation applies; one rule for every caller)."""
    return query.shape[-1] ** -0.5 if scaling is None else scaling


def attend_selection(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one decode position over selected rows and itself, in fp32.

    query [B, H, 1, d]; key, value [B, Hkv, n + 1, d] (the fetched rows, then the current token);
    valid [B, Hkv, n + 1] (False at the padding slots of a ragged selection). Each KV head's
    group of H / Hkv query heads attends its rows as one [G, n + 1] product: no row is copied
    per query head. Returns the output [B, 1, H, d] in the query's dtype and the weights
    [B, H, 1, n + 1]."""
    b, h, _, d = query.shape
    hkv, n1 = key.shape[1], key.shape[2]
    q = query.reshape(b, hkv, h // hkv, d).to(torch.float32)  # head j of the group of KV head j // G
    k = key if key.dtype == torch.float32 else key.to(torch.float32)
    v = value if value.dtype == torch.float32 else value.to(torch.float32)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hkv, G, n + 1]
    scores = scores.masked_fill(~valid[:, :, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v).to(query.dtype)  # [B, Hkv, G, d]
    return out.reshape(b, 1, h, d), probs.reshape(b, h, 1, n1)


def attend_selection_output(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scaling: float
) -> torch.Tensor:
    """`attend_selection`'s output alone, through torch's fused attention (no weights are
    materialized): for selectors that do not look at the weights. Output [B, 1, H, d]."""
    b, h, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, h // hkv, d).to(torch.float32)
    k = key if key.dtype == torch.float32 else key.to(torch.float32)
    v = value if value.dtype == torch.float32 else value.to(torch.float32)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, :, None, :], scale=scaling)
    return out.to(query.dtype).reshape(b, 1, h, d)


def register_attention() -> None:
    """Make "infinigen" a valid attn_implementation (idempotent; a global registry, not the model)."""
    AttentionInterface.register(ATTN_NAME, infinigen_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
