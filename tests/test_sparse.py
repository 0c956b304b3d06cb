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
from infinigen import InfiniGenCache, InfiniGenConfig, detach

SPARSE = InfiniGenConfig(alpha=1.0, min_tokens=2, calibration_tokens=64, aggregation="union")


class RecordingCache(InfiniGenCache):
    """Keeps every step's selection of every speculated layer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []

    def select(self, layer_idx, x, position_embeddings):
        super().select(layer_idx, x, position_embeddings)
        if layer_idx == self.ig_config.dense_layers:
            self.record.append({})
        pf = self.layers[layer_idx].prefetched
        if pf is not None:
            self.record[-1][layer_idx] = (pf[0].indices.clone(), pf[0].valid.clone())


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
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    logits = [out.logits[:, -1]]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache)
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
    cache = RecordingCache(model, config, progress=False)
    steps = 6
    got = _forced(model, ids, mask, cache, steps)
    fractions = [p["fetched_fraction"] for p in cache.summary()["per_layer"] if p["speculated"]]
    assert max(fractions) < 0.9, "selection must actually be sparse for this test to mean anything"
    folded = cache.attachment.folded
    detach(model)
    assert not folded or model.config._attn_implementation != "infinigen"

    # Replay: the same tokens through the plain model, masking attention to the recorded sets.
    model.set_attn_implementation("test_masked")
    ref_cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, past_key_values=ref_cache)
    ref = [out.logits[:, -1]]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    m = mask
    for step in range(steps):
        m = torch.cat([m, torch.ones_like(nxt)], dim=1)
        past = m.shape[1] - 1
        _MASKS.clear()
        for layer, (idx, valid) in cache.record[step].items():
            hits = torch.zeros(idx.shape[0], idx.shape[1], past + 1, dtype=torch.long)
            allowed = hits.scatter_add_(-1, idx, valid.long()) > 0  # padding slots add 0
            allowed[..., past] = True  # the current token is always attended
            # Padding must never have been selected.
            assert not (allowed[..., :past] & ~m[:, None, :past].bool()).any()
            _MASKS[layer] = allowed
        out = model(input_ids=nxt, attention_mask=m, past_key_values=ref_cache)
        ref.append(out.logits[:, -1])
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    _MASKS.clear()
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(got, torch.stack(ref), rtol=1e-4, atol=1e-4)


def test_current_token_is_always_attended():
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=30)
    cache = InfiniGenCache(model, InfiniGenConfig(alpha=0.0, min_tokens=1, calibration_tokens=64), progress=False)
    model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, past_key_values=cache, pad_token_id=0
    )
    for i in range(cache.ig_config.dense_layers, len(cache.layers)):
        valid = cache.layers[i].attend_valid
        assert valid is not None and valid[..., -1].all()
        assert (valid.sum(-1) >= 2).all()  # floor of one past position + the current token
    detach(model)
