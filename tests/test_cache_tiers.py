"""The cache on every tier: identical outputs, overlapped transfers, files cleaned up."""

import math

import pytest
import torch

from conftest import left_padded_batch, tiny_model
from infinigen import InfiniGenCache, InfiniGenConfig, detach
from infinigen.kv.disk import KVStorageError


def _generate(model, ids, mask, cache, n=6):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        do_sample=False,
        past_key_values=cache,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )


@pytest.mark.parametrize("policy,alpha", [("infinigen", math.inf), ("infinigen", 1.0), ("full", 5.0)])
def test_disk_tier_matches_ram_tier_bit_for_bit(tmp_path, policy, alpha):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=40, pad=6)
    base = dict(policy=policy, alpha=alpha, calibration_tokens=64, kv_dtype="float16", min_tokens=2)
    ram = InfiniGenCache(model, InfiniGenConfig(tier="ram", **base), progress=False)
    out_ram = _generate(model, ids, mask, ram)
    disk = InfiniGenCache(model, InfiniGenConfig(tier="disk", kv_dir=str(tmp_path), **base), progress=False)
    out_disk = _generate(model, ids, mask, disk)
    assert torch.equal(out_ram.sequences, out_disk.sequences)
    for a, b in zip(out_ram.logits, out_disk.logits):
        assert torch.equal(a, b)
    tiered = [(lr, ld) for lr, ld in zip(ram.layers, disk.layers) if ld.tier is not None]
    assert len(tiered) == len(disk.layers) - (2 if policy == "infinigen" else 0)  # dense layers stay on compute
    for lr, ld in tiered:
        kr, vr = lr.tier.peek_all()
        kd, vd = ld.tier.peek_all()
        assert torch.equal(kr, kd) and torch.equal(vr, vd)
    s_ram, s_disk = ram.summary(), disk.summary()
    assert s_ram["rows_fetched"] == s_disk["rows_fetched"]
    assert s_disk["bytes_fetched"] >= s_ram["bytes_fetched"]  # whole 4 KiB blocks
    assert s_disk["read_amplification"] >= 1.0
    assert len(list(tmp_path.iterdir())) == len(tiered)
    disk.close()
    assert list(tmp_path.iterdir()) == []
    detach(model)


def test_every_decode_layer_waits_only_on_its_own_prefetch(tmp_path):
    model = tiny_model("qwen2")
    ids, mask = left_padded_batch(length=30)
    cfg = InfiniGenConfig(alpha=2.0, calibration_tokens=64, tier="disk", kv_dir=str(tmp_path))
    cache = InfiniGenCache(model, cfg, progress=False)
    issued = []
    orig = cache.prefetch

    def spy(layer_idx, x, pe, own=False):
        layer = cache.layers[layer_idx]
        before = layer.prefetched
        orig(layer_idx, x, pe, own=own)
        if before is None and layer.prefetched is not None:  # this call issued the transfer
            issued.append((layer.length, layer_idx, own))  # past length: one value per step

    cache.prefetch = spy
    with cache:
        _generate(model, ids, mask, cache, n=4)
        s = cache.summary()
        # One set of I/O threads for the whole cache, not one per layer.
        assert len({id(layer.tier._pools()[1]) for layer in cache.layers if layer.tier is not None}) == 1
    # Every tiered layer of every decode step had its transfer issued one layer ahead.
    steps, prompt = s["decode_steps"], ids.shape[1]
    tiered = [i for i in range(len(cache.layers)) if not cache.on_compute(i)]
    assert tiered == [2, 3]
    want = [(prompt + t, i, False) for t in range(steps) for i in tiered]
    assert sorted(issued) == want
    assert all(p["wait_seconds"] >= 0 for p in s["per_layer"])
    assert s["wait_seconds"] == pytest.approx(sum(p["wait_seconds"] for p in s["per_layer"]))
    assert list(tmp_path.iterdir()) == []
    detach(model)


def test_no_room_for_the_kv_files_fails_before_anything_is_written(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    cache = InfiniGenCache(
        model, InfiniGenConfig(tier="disk", kv_dir=str(tmp_path), calibration_tokens=64), progress=False
    )
    with pytest.raises(KVStorageError, match="not enough free space"):
        _generate(model, ids, mask, cache)
    assert list(tmp_path.iterdir()) == []
    assert all(layer.tier is None for layer in cache.layers)
    detach(model)


def test_unwritable_kv_directory_is_a_clear_error(tmp_path):
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = InfiniGenConfig(policy="full", tier="disk", kv_dir=str(blocker / "sub"))
    cache = InfiniGenCache(model, cfg, progress=False)
    with pytest.raises(KVStorageError, match="cannot be created|not a writable"):
        _generate(model, ids, mask, cache)
    detach(model)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_kv_files_removed_when_generation_raises(tmp_path, exc):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Interrupt(StoppingCriteria):  # raised from inside generate, mid-decode
        def __call__(self, input_ids, scores, **kwargs):
            assert list(tmp_path.iterdir())
            raise exc("boom")

    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    cfg = InfiniGenConfig(policy="full", tier="disk", kv_dir=str(tmp_path))
    with pytest.raises(exc, match="boom"):
        with InfiniGenCache(model, cfg, progress=False) as cache:
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=4, past_key_values=cache,
                stopping_criteria=StoppingCriteriaList([Interrupt()]), pad_token_id=0,
            )  # fmt: skip
    assert list(tmp_path.iterdir()) == []
    detach(model)


def test_two_caches_never_share_a_file(tmp_path):
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    cfg = InfiniGenConfig(policy="full", tier="disk", kv_dir=str(tmp_path))
    a = InfiniGenCache(model, cfg, progress=False)
    _generate(model, ids, mask, a, n=2)
    b = InfiniGenCache(model, cfg, progress=False)
    _generate(model, ids, mask, b, n=2)
    files_a = {layer.tier.path for layer in a.layers if layer.tier is not None}
    files_b = {layer.tier.path for layer in b.layers if layer.tier is not None}
    assert len(files_a) == len(a.layers) and not files_a & files_b
    a.close()
    b.close()
    detach(model)


def test_host_pool_at_full_capacity_changes_nothing():
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=40, pad=6)
    base = dict(alpha=1.0, calibration_tokens=64, min_tokens=2)
    ref = _generate(model, ids, mask, InfiniGenCache(model, InfiniGenConfig(**base), progress=False))
    pooled = InfiniGenCache(model, InfiniGenConfig(host_capacity=1.0, **base), progress=False)
    out = _generate(model, ids, mask, pooled)
    assert torch.equal(out.sequences, ref.sequences)
    assert pooled.summary()["evictions"] == 0
    detach(model)


@pytest.mark.parametrize("eviction", ["counter", "lru", "fifo"])
def test_capped_host_pool_evicts_and_never_selects_what_it_evicted(eviction):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=40, pad=6)
    cfg = InfiniGenConfig(alpha=2.0, calibration_tokens=64, host_capacity=0.5, eviction=eviction, min_tokens=2)
    cache = InfiniGenCache(model, cfg, progress=False)
    seen = []
    orig = cache.select

    def spy(layer_idx, x, pe):
        orig(layer_idx, x, pe)
        layer = cache.layers[layer_idx]
        sel = layer.prefetched[0]
        resident = layer.pool.resident(layer.length)
        chosen = torch.zeros_like(resident, dtype=torch.long).scatter_add_(-1, sel.indices, sel.valid.long()) > 0
        seen.append(bool((chosen & ~resident).any()))

    cache.select = spy
    _generate(model, ids, mask, cache, n=8)
    s = cache.summary()
    assert s["evictions"] > 0 and seen and not any(seen)
    for layer in cache.layers[cfg.dense_layers :]:
        assert layer.pool.capacity == 20 and layer.tier.length == 20
    detach(model)
