"""Pinned-host tier with CUDA side streams (skipped without a GPU)."""

import pytest
import torch

from infinigen.storage import RamTier, TransferStats

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_pinned_tier_refuses_to_start_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from infinigen.storage import PinnedTier

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        PinnedTier(1, 1, 8, torch.float16, TransferStats(), "cuda")


@cuda
def test_pinned_matches_ram_without_device_synchronize(monkeypatch):
    from infinigen.storage import PinnedTier

    def no_sync(*a, **k):
        raise AssertionError("device-wide synchronize on the decode path")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    g = torch.Generator().manual_seed(0)
    ram, pin = (
        RamTier(2, 3, 64, torch.float16, TransferStats()),
        PinnedTier(2, 3, 64, torch.float16, TransferStats(), "cuda"),
    )
    k = torch.randn(2, 3, 300, 64, generator=g)
    v = torch.randn(2, 3, 300, 64, generator=g)
    ram.append(k, v)
    pin.append(k.cuda(), v.cuda())
    for _ in range(20):
        k1, v1 = torch.randn(2, 3, 1, 64, generator=g), torch.randn(2, 3, 1, 64, generator=g)
        ram.append(k1, v1)
        pin.append(k1.cuda(), v1.cuda())
        idx = torch.randint(0, ram.length, (2, 3, 17), generator=g).sort(-1).values
        valid = torch.rand(2, 3, 17, generator=g) > 0.2
        kr, vr = ram.gather(idx, valid, "cpu", torch.float32)
        kp, vp = pin.gather_async(idx.cuda(), valid.cuda(), torch.device("cuda"), torch.float32).result()
        assert torch.equal(kr, kp.cpu()) and torch.equal(vr, vp.cpu())
    ka, va = pin.read_all_async(ram.length, torch.device("cuda"), torch.float32).result()
    kr, vr = ram.read_all(ram.length, "cpu", torch.float32)
    assert torch.equal(ka.cpu(), kr) and torch.equal(va.cpu(), vr)
    assert pin.stats.rows == ram.stats.rows and pin.stats.bytes == ram.stats.bytes


@cuda
def test_cache_on_cuda_with_pinned_tier_matches_dynamic_cache():
    import math

    from transformers import DynamicCache

    from conftest import left_padded_batch, tiny_model
    from infinigen import InfiniGenConfig, attach

    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in left_padded_batch())
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    kw.update(output_logits=True, return_dict_in_generate=True)
    ref = model.generate(past_key_values=DynamicCache(config=model.config), **kw)
    cfg = InfiniGenConfig(alpha=math.inf, budget=1.0, tier="pinned", calibration_tokens=64)
    with attach(model, cfg, progress=False) as session:
        out = model.generate(past_key_values=session.new_cache(), **kw)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        sparse = session.new_cache(cfg.replace(alpha=1.0))
        model.generate(past_key_values=sparse, **kw)
        assert 0 < sparse.summary()["fetched_fraction"] <= 1
