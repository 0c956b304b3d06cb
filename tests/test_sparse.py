"""The sparse decode path attends exactly over (selection ∪ current token).

Reference: the unmodified model with a DynamicCache and an attention function that applies
the recorded selections as an explicit mask — computed independently of the tier, the
gather and the compacted attention.
"""

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from conftest import left_padded_batch, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.compat import cache_kwargs

SPARSE = InfiniGenConfig(alpha=1.0, min_tokens=2, calibration_tokens=64, aggregation="union")


def selections_by_step(trace) -> dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The cache's transfer records as {context length: {layer: (indices, valid)}}."""
    out: dict[int, dict] = {}
    for r in trace:
        if r.selection is not None:
            out.setdefault(r.past, {})[r.layer] = (r.selection.indices, r.selection.valid)
    return out


_MASKS: dict[int, torch.Tensor] = {}


def _masked_attention(module, query, key, value, attention_mask, **kwargs):
    extra = _MASKS.get(module.layer_idx)
    if extra is not None:
        h = query.shape[1]
        allowed = extra.repeat_interleave(h // extra.shape[1], dim=1)[:, :, None, :]
        attention_mask = allowed if attention_mask is None else attention_mask & allowed
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("test_masked", _masked_attention)
AttentionMaskInterface.register("test_masked", sdpa_mask)


def _forced(model, ids, mask, cache, steps):
    out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache))
    logits = [out.logits[:, -1]]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        out = model(input_ids=nxt, attention_mask=mask, **cache_kwargs(model, cache))
        logits.append(out.logits[:, -1])
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.stack(logits)


BASELINE = dict(budget=0.3, calibration_tokens=64)


@pytest.mark.parametrize(
    "family,config",
    [
        ("llama", SPARSE),
        ("opt", SPARSE),
        ("llama", InfiniGenConfig(policy="h2o", **BASELINE)),
        ("llama", InfiniGenConfig(policy="streaming", sinks=2, **BASELINE)),
        ("llama", InfiniGenConfig(policy="quest", page_tokens=4, **BASELINE)),
        ("llama", InfiniGenConfig(policy="oracle", **BASELINE)),
        ("qwen2", InfiniGenConfig(policy="h2o", kv_dtype="float16", **BASELINE)),
    ],
    ids=["infinigen-llama", "infinigen-opt", "h2o", "streaming", "quest", "oracle", "h2o-fp16"],
)
def test_sparse_decode_equals_masked_dense_attention(family, config):
    """Every selecting policy attends exactly (its selection ∪ the current token)."""
    model = tiny_model(family)
    ids, mask = left_padded_batch(length=40, pad=9)
    steps = 6
    with attach(model, config, progress=False) as session:
        cache = session.new_cache(trace=True)
        got = _forced(model, ids, mask, cache, steps)
    fractions = [p["fetched_fraction"] for p in cache.summary()["per_layer"] if p["speculated"]]
    assert max(fractions) < 0.9, "selection must actually be sparse for this test to mean anything"
    record = selections_by_step(cache.trace)
    assert sorted(record) == [ids.shape[1] + s for s in range(steps)]

    torch.testing.assert_close(got, masked_replay(model, ids, mask, record, steps), rtol=1e-4, atol=1e-4)


def masked_replay(model, ids, mask, record, steps):
    """The same greedy tokens through the plain model with a DynamicCache, each speculated layer's
    attention masked to the recorded selection plus the current token."""
    model.set_attn_implementation("test_masked")
    ref_cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, ref_cache))
    ref = [out.logits[:, -1]]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    m = mask
    try:
        for _ in range(steps):
            m = torch.cat([m, torch.ones_like(nxt)], dim=1)
            past = m.shape[1] - 1
            _MASKS.clear()
            for layer, (idx, valid) in record[past].items():
                hits = torch.zeros(idx.shape[0], idx.shape[1], past + 1, dtype=torch.long)
                allowed = hits.scatter_add_(-1, idx, valid.long()) > 0  # padding slots add 0
                allowed[..., past] = True  # the current token is always attended
                # Padding must never have been selected.
                assert not (allowed[..., :past] & ~m[:, None, :past].bool()).any()
                _MASKS[layer] = allowed
            out = model(input_ids=nxt, attention_mask=m, **cache_kwargs(model, ref_cache))
            ref.append(out.logits[:, -1])
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    finally:
        _MASKS.clear()
        model.set_attn_implementation("sdpa")
    return torch.stack(ref)


def test_current_token_is_always_attended():
    """alpha = 0 with a floor of one: each KV head keeps its query heads' top positions only (one
    or two with union over a group of two), and the output is exactly the masked dense attention
    over them and the current token."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=30)
    cfg = InfiniGenConfig(alpha=0.0, min_tokens=1, calibration_tokens=64)
    with attach(model, cfg, progress=False) as session:
        cache = session.new_cache(trace=True)
        got = _forced(model, ids, mask, cache, 2)
    record = selections_by_step(cache.trace)
    counts = [v.sum(-1) for step in record.values() for _, v in step.values()]
    assert all(int(c.min()) >= 1 and int(c.max()) <= 2 for c in counts)
    torch.testing.assert_close(got, masked_replay(model, ids, mask, record, 2), rtol=1e-4, atol=1e-4)
