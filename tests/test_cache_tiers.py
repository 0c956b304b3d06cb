"""The cache on every tier: identical outputs, overlapped transfers, files released."""

import math

import pytest
import torch

from conftest import left_padded_batch, open_files_in, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.compat import cache_kwargs
from infinigen.storage import KVStorageError


def _generate(model, ids, mask, cache, n=6):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        do_sample=False,
        **cache_kwargs(model, cache),
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )


@pytest.mark.parametrize(
    "policy,alpha,extra",
    [
        ("infinigen", math.inf, {}),
        ("infinigen", 1.0, {}),
        ("full", 5.0, {}),
        ("infinigen", math.inf, {"budget": 0.15, "correction": 0.05}),  # the top-up is a second gather
        ("infinigen", math.inf, {"block_tokens": 4}),  # units: the same on both tiers when named
    ],
)
def test_disk_tier_matches_ram_tier_bit_for_bit(tmp_path, policy, alpha, extra):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=100, pad=6)  # 64 positions per 4 KiB block at d = 16: disk and RAM tail
    # Row by row unless a unit is named: left unset, each tier would choose in its own read unit.
    unit = {"block_tokens": 1, **extra}
    base = InfiniGenConfig(policy=policy, alpha=alpha, calibration_tokens=64, kv_dtype="float16", min_tokens=2, **unit)
    with attach(model, base, progress=False) as session:
        ram = session.new_cache(base)
        out_ram = _generate(model, ids, mask, ram)
        disk = session.new_cache(base.replace(tier="disk", kv_dir=str(tmp_path)), trace=True)
        out_disk = _generate(model, ids, mask, disk)
        files = open_files_in(tmp_path)
        s_ram, s_disk = ram.summary(), disk.summary()
        disk.close()
    assert torch.equal(out_ram.sequences, out_disk.sequences)
    for a, b in zip(out_ram.logits, out_disk.logits):
        assert torch.equal(a, b)
    offloaded = [p for p in s_disk["per_layer"] if p["role"] != "compute"]
    assert len(offloaded) == len(s_disk["per_layer"]) - (2 if policy == "infinigen" else 0)  # dense layers on compute
    assert len(files) == len(offloaded)  # one file per offloaded layer, none with a name
    assert s_ram["rows_fetched"] == s_disk["rows_fetched"]
    assert s_ram["correction_bytes"] == s_disk["correction_bytes"] and (s_ram["correction_bytes"] > 0) == (
        "correction" in extra
    )
    assert s_disk["bytes_fetched"] >= s_ram["bytes_fetched"]  # whole 4 KiB blocks
    assert s_disk["read_amplification"] >= 1.0 and s_ram["read_amplification"] == 1.0
    assert 0 < s_disk["bytes_cached"] < s_disk["bytes_fetched"]  # the unwritten tail block came from RAM
    assert list(tmp_path.iterdir()) == [] and open_files_in(tmp_path) == []


def test_every_decode_layer_waits_only_on_its_own_prefetch(tmp_path):
    model = tiny_model("qwen2")
    ids, mask = left_padded_batch(length=30)
    cfg = InfiniGenConfig(alpha=2.0, calibration_tokens=64, tier="disk", kv_dir=str(tmp_path))
    with attach(model, cfg, progress=False) as session, session.new_cache(trace=True) as cache:
        _generate(model, ids, mask, cache, n=4)
        s = cache.summary()
    # Every offloaded layer of every decode step had its transfer issued one layer ahead.
    steps, prompt = s["decode_steps"], ids.shape[1]
    offloaded = [p["layer"] for p in s["per_layer"] if p["role"] != "compute"]
    assert offloaded == [2, 3]
    issued = sorted((r.past, r.layer, r.issued_at) for r in cache.trace)
    assert issued == [(prompt + t, i, i - 1) for t in range(steps) for i in offloaded]
    assert all(r.selection is not None for r in cache.trace)
    assert all(p["wait_seconds"] >= 0 for p in s["per_layer"])
    assert s["wait_seconds"] == pytest.approx(sum(p["wait_seconds"] for p in s["per_layer"]))
    assert list(tmp_path.iterdir()) == []


def test_own_query_selectors_are_issued_at_their_own_layer():
    """Quest and the oracle need layer i's true query: nothing can go ahead of it."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=30)
    for policy in ("quest", "oracle"):
        cfg = InfiniGenConfig(policy=policy, budget=0.3, page_tokens=4)
        with attach(model, cfg, progress=False) as session:
            cache = session.new_cache(trace=True)
            _generate(model, ids, mask, cache, n=3)
        assert cache.trace and all(r.issued_at == r.layer for r in cache.trace), policy


def test_no_room_for_the_kv_files_fails_before_anything_is_written(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    cfg = InfiniGenConfig(tier="disk", kv_dir=str(tmp_path), calibration_tokens=64)
    with attach(model, cfg, progress=False) as session:
        cache = session.new_cache()
        with pytest.raises(KVStorageError, match="not enough free space"):
            _generate(model, ids, mask, cache)
        assert cache.summary()["bytes_fetched"] == 0
    assert list(tmp_path.iterdir()) == []


def test_unwritable_kv_directory_is_a_clear_error(tmp_path):
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = InfiniGenConfig(policy="full", tier="disk", kv_dir=str(blocker / "sub"))
    with attach(model, cfg, progress=False) as session:
        with pytest.raises(KVStorageError, match="does not exist: create it"):  # never created behind the user's back
            _generate(model, ids, mask, session.new_cache())


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_kv_files_removed_when_generation_raises(tmp_path, exc):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Interrupt(StoppingCriteria):  # raised from inside generate, mid-decode
        def __call__(self, input_ids, scores, **kwargs):
            assert open_files_in(tmp_path)
            raise exc("boom")

    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    cfg = InfiniGenConfig(policy="full", tier="disk", kv_dir=str(tmp_path))
    with pytest.raises(exc, match="boom"):
        with attach(model, cfg, progress=False) as session:
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=4,
                stopping_criteria=StoppingCriteriaList([Interrupt()]), pad_token_id=0,
            )  # fmt: skip
    assert list(tmp_path.iterdir()) == [] and open_files_in(tmp_path) == []
    assert session.last_cache is not None


def test_two_caches_never_share_a_file(tmp_path):
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    cfg = InfiniGenConfig(policy="full", tier="disk", kv_dir=str(tmp_path))
    layers = model.config.num_hidden_layers
    with attach(model, cfg, progress=False) as session:
        a = session.new_cache()
        _generate(model, ids, mask, a, n=2)
        files_a = set(open_files_in(tmp_path))
        b = session.new_cache()
        _generate(model, ids, mask, b, n=2)
        files_b = set(open_files_in(tmp_path)) - files_a
        assert len(files_a) == len(files_b) == layers
        a.close()
        assert set(open_files_in(tmp_path)) == files_b
        b.close()
    assert list(tmp_path.iterdir()) == [] and open_files_in(tmp_path) == []


def test_host_pool_at_full_capacity_changes_nothing():
    """A pool with room for every position of the generation must be invisible: the same tokens,
    logits, rows and bytes as no pool, and no eviction — while it really is a pool."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=40, pad=6)
    n = 8
    cfg = InfiniGenConfig(alpha=1.0, calibration_tokens=64, min_tokens=2)
    with attach(model, cfg, progress=False) as session:
        plain = session.new_cache(max_length=ids.shape[1] + n)
        ref = _generate(model, ids, mask, plain, n=n)
        pooled = session.new_cache(cfg.replace(host_capacity=1.0), max_length=ids.shape[1] + n)
        out = _generate(model, ids, mask, pooled, n=n)
        s_plain, s_pool = plain.summary(), pooled.summary()
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert torch.equal(a, b)
    speculated = model.config.num_hidden_layers - cfg.dense_layers
    assert s_pool["host_pool_slots"] == speculated * 2 * 2 * (ids.shape[1] + n)  # B * Hkv slots per layer
    assert s_plain["host_pool_slots"] == 0
    assert s_pool["evictions"] == 0
    assert s_pool["rows_fetched"] == s_plain["rows_fetched"] and s_pool["bytes_fetched"] == s_plain["bytes_fetched"]
    assert s_pool["fetched_fraction"] == s_plain["fetched_fraction"] < 1


@pytest.mark.parametrize("eviction", ["counter", "lru", "fifo"])
def test_capped_host_pool_evicts_and_never_selects_what_it_evicted(eviction):
    """Half the positions: evictions happen, and generation succeeds — a gather of an evicted
    position would raise, so no selection named one."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=40, pad=6)
    n = 8
    cfg = InfiniGenConfig(alpha=2.0, calibration_tokens=64, host_capacity=0.5, eviction=eviction, min_tokens=2)
    with attach(model, cfg, progress=False) as session:
        cache = session.new_cache(max_length=ids.shape[1] + n, trace=True)
        _generate(model, ids, mask, cache, n=n)
        s = cache.summary()
    speculated = model.config.num_hidden_layers - cfg.dense_layers
    assert s["evictions"] > 0 and s["host_pool_slots"] == speculated * 2 * 2 * 24  # ceil(0.5 * 48)
    assert len(cache.trace) == speculated * (n - 1)
    # Every selection stays within the pool's capacity per (batch row, KV head).
    assert all(int(r.selection.counts.max()) <= 24 for r in cache.trace)


def _fill(directory, name="filler") -> int:
    """Write a file in `directory` until its disk is full; its size."""
    import errno

    size = 0
    with open(directory / name, "wb", buffering=0) as f:
        chunk = b"\0" * 4096
        while True:
            try:
                size += f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return size


def test_a_disk_that_fills_mid_run_fails_clearly_and_frees_the_files(mount_tmpfs):
    """A real full disk (a 512 KiB tmpfs): the run reserved its prompt's room and grows on
    demand (a cache kept for a continuation, return_dict_in_generate, is not sized to this call's
    length); another writer then takes the rest of the disk; the next growth fails with the
    sentence, and the KV files' blocks are free again once the error has unwound."""
    import shutil

    from transformers import StoppingCriteria, StoppingCriteriaList

    disk = mount_tmpfs("512k")
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=40, pad=4)
    cfg = InfiniGenConfig(policy="full", tier="disk", kv_dir=str(disk), kv_dtype="float32")

    class FillTheDisk(StoppingCriteria):  # another process takes the free space after the first token
        def __call__(self, input_ids, scores, **kwargs):
            if not (disk / "filler").exists():
                assert open_files_in(disk) and list(disk.iterdir()) == []
                _fill(disk)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with attach(model, cfg, progress=False):
        try:
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=100, do_sample=False, pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([FillTheDisk()]), return_dict_in_generate=True,
            )  # fmt: skip
        except KVStorageError as exc:
            if "O_DIRECT" in str(exc):
                pytest.skip("this kernel's tmpfs refuses O_DIRECT")
            raised = exc
        else:
            raise AssertionError("the generation fit on a full disk")
    assert str(raised).startswith(f"the disk holding the KV files ({disk}) is full: growing a layer's KV to ")
    assert "\n" not in str(raised)
    assert [p.name for p in disk.iterdir()] == ["filler"] and open_files_in(disk) == []
    (disk / "filler").unlink()
    assert shutil.disk_usage(disk).used == 0  # every KV block is free again


def test_a_run_whose_length_is_known_reserves_it_and_survives_a_full_disk(mount_tmpfs):
    """The same full disk, but the cache knows the run's length (max_length, as the command
    line passes it): its room was allocated up front, so the run completes, identical to RAM."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    disk = mount_tmpfs("512k")
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=40, pad=4)
    cfg = InfiniGenConfig(policy="full", tier="disk", kv_dir=str(disk), kv_dtype="float32")

    class FillTheDisk(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if not (disk / "filler").exists():
                _fill(disk)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    n = 100
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
    with attach(model, cfg, progress=False) as session:
        try:
            with session.new_cache(max_length=ids.shape[1] + n) as cache:
                out = model.generate(
                    **kwargs, **cache_kwargs(model, cache), stopping_criteria=StoppingCriteriaList([FillTheDisk()])
                )
        except KVStorageError as exc:
            if "O_DIRECT" in str(exc):
                pytest.skip("this kernel's tmpfs refuses O_DIRECT")
            raise
        ref = model.generate(**kwargs, **cache_kwargs(model, session.new_cache(cfg.replace(tier="ram"))))
    assert (disk / "filler").exists() and torch.equal(out, ref)
    assert [p.name for p in disk.iterdir()] == ["filler"] and open_files_in(disk) == []


@pytest.mark.parametrize("tier", ["ram", "disk"])
@pytest.mark.parametrize("policy", ["full", "infinigen"])
@pytest.mark.parametrize("chunk", [7, 60, 200])  # many chunks, two (both read ahead), one
def test_every_row_read_in_chunks_attends_as_the_whole_layer_does(tmp_path, tier, policy, chunk):
    """`fetch_chunk`: a layer that reads every row (full fetch; InfiniGen's dense layers when read
    from the tier) attends it a chunk at a time with a carried softmax. Against the same policy
    reading whole layers: the same tokens, logits within fp32 rounding, the same bytes read, and
    transfer buffers that hold chunks, not the context (left padding masked inside chunks)."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=100, pad=6)
    base = InfiniGenConfig(
        policy=policy, calibration_tokens=64, kv_dtype="float16", min_tokens=2, tier=tier,
        kv_dir=str(tmp_path), dense_layers_on_compute=False, block_tokens=1,
    )  # fmt: skip
    with attach(model, base, progress=False) as session:
        whole = session.new_cache(base)
        out_whole = _generate(model, ids, mask, whole)
        chunked = session.new_cache(base.replace(fetch_chunk=chunk))  # 100 positions and 6 new
        out_chunked = _generate(model, ids, mask, chunked)
        s_whole, s_chunked = whole.summary(), chunked.summary()
        m_whole, m_chunked = whole.memory(), chunked.memory()
        whole.close()
        chunked.close()
    assert torch.equal(out_whole.sequences, out_chunked.sequences)
    for a, b in zip(out_whole.logits, out_chunked.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert s_chunked["rows_fetched"] == s_whole["rows_fetched"]
    if tier == "ram":
        assert s_chunked["bytes_fetched"] == s_whole["bytes_fetched"]
    assert "dense_layers" not in {k for k, v in m_chunked.parts.items() if v}
    if chunk < 100:
        assert m_chunked.parts["transfer_buffers"] < m_whole.parts["transfer_buffers"]
