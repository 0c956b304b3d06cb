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


def attend_selection(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one decode position over selected rows and itself, in fp32.

    query [B, H, 1, d]; key, value [B, Hkv, n + 1, d] (the fetched rows, then the current token);
    valid [B, Hkv, n + 1] (False at the padding slots of a ragged selection). Returns the
    output [B, 1, H, d] in the query's dtype and the weights [B, H, 1, n + 1]."""
    h, hkv = query.shape[1], key.shape[1]
    k = key.repeat_interleave(h // hkv, dim=1).to(torch.float32)
    v = value.repeat_interleave(h // hkv, dim=1).to(torch.float32)
    allowed = valid.repeat_interleave(h // hkv, dim=1)[:, :, None, :]
    scores = torch.matmul(query.to(torch.float32), k.transpose(-1, -2)) * scaling
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    out = torch.matmul(probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), probs


def register_attention() -> None:
    """Make "infinigen" a valid attn_implementation (idempotent; a global registry, not the model)."""
    AttentionInterface.register(ATTN_NAME, infinigen_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
