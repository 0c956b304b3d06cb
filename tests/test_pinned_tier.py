"""The pinned tier's transfer protocol: on CPU threads that mimic asynchronous copies (always run),
and on CUDA side streams (skipped without a GPU).

The thread engine delays every copy, so a reader that does not wait for a transfer's marker sees
the old contents of its buffer and the comparison with the RAM tier fails.
"""

import contextlib
import math

import pytest
import torch
from transformers import DynamicCache

from conftest import greedy_with_logits, left_padded_batch, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.compat import cache_kwargs
from infinigen.storage import (
    KVStorageError,
    PinnedTier,
    RamTier,
    Storage,
    ThreadCopyEngine,
    TransferStats,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pair_against_ram(engine, device, delay_rows: int = 300):
    g = torch.Generator().manual_seed(0)
    ram = RamTier(2, 3, 64, torch.float16, TransferStats())
    pin = PinnedTier(2, 3, 64, torch.float16, TransferStats(), engine, capacity=0)
    k = torch.randn(2, 3, delay_rows, 64, generator=g)
    v = torch.randn(2, 3, delay_rows, 64, generator=g)
    ram.append(k, v)
    pin.append(k.to(device), v.to(device))
    return g, ram, pin


def test_host_tiers_grow_by_the_one_growth_rule():
    """The RAM and pinned tiers, given no capacity, make room for at least 64 positions and then
    a quarter more each time they fill (`grown_size`), not double."""
    from infinigen.growing import grown_size

    engine = ThreadCopyEngine(delay=0.0)
    tiers = [
        RamTier(1, 2, 8, torch.float16, TransferStats()),
        PinnedTier(1, 2, 8, torch.float16, TransferStats(), engine),
    ]
    room = 0
    for n in (3, 70, 1, 1, 30):
        if tiers[0].length + n > room:
            room = grown_size(room, tiers[0].length + n)
        for tier in tiers:
            tier.append(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8))
            assert tier.stored_bytes() == room * 2 * tier.row_bytes
    tiers[1].close()
    engine.close()


def _check_against_ram(engine, device):
    """Appends, gathers into reused buffers, and full reads: equal to the RAM tier, bit for bit."""
    g, ram, pin = _pair_against_ram(engine, device)
    buffers = [tuple(torch.zeros(2, 3, 40, 64, device=device) for _ in range(2)) for _ in range(2)]
    for step in range(12):
        k1, v1 = torch.randn(2, 3, 1, 64, generator=g), torch.randn(2, 3, 1, 64, generator=g)
        ram.append(k1, v1)
        pin.append(k1.to(device), v1.to(device))  # the newest row is still being written ...
        idx = torch.randint(0, ram.length, (2, 3, 17), generator=g).sort(-1).values
        idx[..., -1] = ram.length - 1  # ... and is gathered at once
        valid = torch.rand(2, 3, 17, generator=g) > 0.2
        valid[..., -1] = True
        out = buffers[step % 2]
        kr, vr = ram.gather(idx, valid, "cpu", torch.float32, out=tuple(torch.zeros_like(t, device="cpu") for t in out))
        kp, vp = pin.gather_async(
            idx.to(device), valid.to(device), torch.device(device), torch.float32, out=out
        ).result()
        assert torch.equal(kr[valid], kp.cpu()[valid]) and torch.equal(vr[valid], vp.cpu()[valid])
    ka, va = pin.read_all_async(ram.length, torch.device(device), torch.float32).result()
    kr, vr = ram.read_all(ram.length, "cpu", torch.float32)
    assert torch.equal(ka.cpu(), kr) and torch.equal(va.cpu(), vr)
    assert pin.stats.rows == ram.stats.rows and pin.stats.bytes == ram.stats.bytes
    pin.close()


@contextlib.contextmanager
def thread_engine(delay: float):
    """A ThreadCopyEngine whose every copy waits `delay` seconds, closed afterwards."""
    engine = ThreadCopyEngine(delay=delay)
    try:
        yield engine
    finally:
        engine.close()


def test_pinned_tier_on_threads_matches_ram_tier():
    with thread_engine(0.002) as engine:
        _check_against_ram(engine, "cpu")


def test_a_transfer_lands_only_when_waited_for():
    """The copy runs later, on the engine's queue: the buffer holds its old rows until then."""
    with thread_engine(0.3) as engine:
        pin = PinnedTier(1, 2, 8, torch.float16, TransferStats(), engine)
        pin.append(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8))
        out = (torch.full((1, 2, 4, 8), -1.0), torch.full((1, 2, 4, 8), -1.0))
        idx = torch.tensor([[[0, 2], [1, 3]]])
        transfer = pin.gather_async(
            idx, torch.ones_like(idx, dtype=torch.bool), torch.device("cpu"), torch.float32, out=out
        )
        assert (out[0] == -1).all(), "the copy must not have run on the calling thread"
        k, v = transfer.result()
        assert (k == 1).all() and (v == 1).all() and (out[0][:, :, 2:] == -1).all()
        pin.close()


def test_transfers_in_flight_into_different_buffers_do_not_share_staging():
    with thread_engine(0.05) as engine:
        pin = PinnedTier(1, 1, 4, torch.float32, TransferStats(), engine)
        rows = torch.arange(40, dtype=torch.float32).view(1, 1, 10, 4)
        pin.append(rows, -rows)
        outs = [(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)) for _ in range(2)]
        first = pin.gather_async(
            torch.tensor([[[0, 1, 2]]]), torch.ones(1, 1, 3, dtype=torch.bool), "cpu", torch.float32, out=outs[0]
        )
        second = pin.gather_async(
            torch.tensor([[[7, 8, 9]]]), torch.ones(1, 1, 3, dtype=torch.bool), "cpu", torch.float32, out=outs[1]
        )
        again = pin.gather_async(
            torch.tensor([[[4, 5, 6]]]), torch.ones(1, 1, 3, dtype=torch.bool), "cpu", torch.float32, out=outs[0]
        )
        assert torch.equal(second.result()[0], rows[:, :, 7:10])
        first.result()
        assert torch.equal(again.result()[1], -rows[:, :, 4:7])
        pin.close()


def test_pinned_tier_without_cuda_names_the_ways_out():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(KVStorageError, match="needs a CUDA device.*copy_engine='threads'"):
        Storage("pinned", capacity=64, layers=1, device="cpu")
    model = tiny_model("llama")
    with attach(model, InfiniGenConfig(policy="full", tier="pinned"), progress=False) as session:
        with pytest.raises(KVStorageError, match="needs a CUDA device"):
            session.new_cache()


@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_cache_with_the_pinned_protocol_on_threads_matches_the_ram_tier(policy):
    """Through the public API: the pinned tier (on CPU threads) gives the RAM tier's tokens,
    logits and bytes; full fetch also equals transformers' own cache."""
    model = tiny_model("llama")
    cfg = InfiniGenConfig(policy=policy, alpha=1.0, calibration_tokens=64, kv_dtype="float16")
    with attach(model, cfg, progress=False) as session:
        ram = session.new_cache()
        ref = greedy_with_logits(model, ram)
        pinned = session.new_cache(cfg.replace(tier="pinned", copy_engine="threads"))
        out = greedy_with_logits(model, pinned)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.logits, ref.logits):
            assert torch.equal(a, b)
        assert pinned.summary()["bytes_fetched"] == ram.summary()["bytes_fetched"] > 0
        assert pinned.summary()["fetched_fraction"] == ram.summary()["fetched_fraction"]
        pinned.close()
    if policy == "full":
        plain = greedy_with_logits(model, DynamicCache(config=model.config))
        for a, b in zip(out.logits, plain.logits):
            torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)  # KV stored in float16


@cuda
def test_pinned_matches_ram_without_device_synchronize(monkeypatch):
    from infinigen.storage import CudaCopyEngine

    def no_sync(*a, **k):
        raise AssertionError("device-wide synchronize on the decode path")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    _check_against_ram(CudaCopyEngine("cuda"), "cuda")


@cuda
def test_cache_on_cuda_with_pinned_tier_matches_dynamic_cache():
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in left_padded_batch())
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    kw.update(output_logits=True, return_dict_in_generate=True)
    ref = model.generate(**cache_kwargs(model, DynamicCache(config=model.config)), **kw)
    cfg = InfiniGenConfig(alpha=math.inf, budget=1.0, tier="pinned", calibration_tokens=64)
    with attach(model, cfg, progress=False) as session:
        out = model.generate(**cache_kwargs(model, session.new_cache()), **kw)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        sparse = session.new_cache(cfg.replace(alpha=1.0))
        model.generate(**cache_kwargs(model, sparse), **kw)
        assert 0 < sparse.summary()["fetched_fraction"] <= 1
