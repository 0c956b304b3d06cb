"""What a cache keeps with the compute (`cache.memory()`, `summary()["memory"]`, `generate --json`):
each part against the arithmetic of its shapes, computed here from the model's dimensions."""

import json
import math
import re

import pytest
import torch

from conftest import VOCAB, WINDOW, run_cli, tiny_model, tiny_variant
from infinigen import InfiniGenConfig, attach
from infinigen.compat import cache_kwargs
from infinigen.memory import PARTS, memory_line
from infinigen.models import get_adapter

PROMPT, NEW, BATCH = 150, 20, 2


def _run(model, cfg: InfiniGenConfig, *, close: bool = False):
    """Generate NEW tokens after PROMPT for BATCH rows; (memory report, summary, cache)."""
    ids = torch.randint(3, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(3))
    with attach(model, cfg, progress=False) as session:
        cache = session.new_cache(max_length=PROMPT + NEW)
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), max_new_tokens=NEW,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        report, summary = cache.memory(), cache.summary()
        if close:
            cache.close()
        return report, summary, cache


def _kv_row(model, itemsize: int) -> int:
    """One position's K and V over a layer's KV heads, from the model's config."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_key_value_heads * head_dim * itemsize


def test_dense_keeps_its_preallocated_kv_and_dense_kv_bytes_is_the_stored_kv():
    model = tiny_model("llama")
    report, summary, _ = _run(model, InfiniGenConfig(policy="dense"))
    layers, positions = model.config.num_hidden_layers, PROMPT + NEW - 1  # the last token is never fed back
    assert report.positions == positions and report.batch == BATCH
    assert report.dense_kv_bytes == layers * BATCH * positions * _kv_row(model, 4)
    # preallocated for max_length positions, in the compute dtype (fp32 here)
    assert report.parts["dense_layers"] == layers * BATCH * (PROMPT + NEW) * _kv_row(model, 4)
    assert report.tier_kv_bytes == 0 and report.parts["speculation_state"] == 0
    assert summary["compute_kv_bytes"] == report.compute_kv_bytes == sum(report.parts.values())
    assert set(report.parts) == set(PARTS)


def test_full_fetch_keeps_two_layers_of_rows_and_the_tier_holds_the_rest():
    model = tiny_model("llama")
    report, _, _ = _run(model, InfiniGenConfig(policy="full", kv_dtype="float16"))
    layers, positions = model.config.num_hidden_layers, PROMPT + NEW - 1
    two_layers_fp32 = 2 * BATCH * positions * _kv_row(model, 4)  # two buffer pairs, whole context, compute dtype
    assert two_layers_fp32 <= report.parts["transfer_buffers"] <= 2 * two_layers_fp32  # grown by doubling
    assert report.parts["dense_layers"] == report.parts["speculation_state"] == 0
    assert report.dense_kv_bytes == layers * BATCH * positions * _kv_row(model, 2)
    assert report.tier_kv_bytes >= report.dense_kv_bytes  # every position of every layer, fp16, room included
    assert report.tier == "ram"


@pytest.mark.parametrize("policy", ["infinigen", "quest"])
def test_selected_rows_land_in_the_kvs_own_16_bits_and_int4_rows_in_the_compute_dtype(policy):
    """A selection's rows read from disk land as stored (16 bits: half of fp32's buffers) and are
    widened while attended; in host RAM beside the CPU they are attended where they lie, with no
    buffer at all; a layer read whole lands in the compute dtype, with the new token after it, for
    the model's own attention (whatever the storage: 16 bits, int4)."""
    model = tiny_model("llama")

    def held(policy: str, kv: str, tier: str = "ram") -> int:
        cfg = InfiniGenConfig(policy=policy, kv_dtype=kv, tier=tier, compute_memory=None)
        return _run(model, cfg)[0].parts["transfer_buffers"]

    assert 0 < held(policy, "float16", "disk") and 2 * held(policy, "float16", "disk") == held(
        policy, "float32", "disk"
    )
    assert held(policy, "float16") == held(policy, "float32") == 0
    assert held("full", "float16") == held("full", "float32") == held("int4", "float16")


def test_the_disk_tiers_of_a_cache_share_one_read_buffer_and_report_their_block_cache():
    """Reads run one at a time on the cache's I/O thread: one buffer, not one per layer (which held
    twice dense's KV for full fetch at 4K). The block cache holds `block_cache` of each layer's blocks."""
    model = tiny_model("llama")
    cfg = InfiniGenConfig(policy="full", tier="disk", kv_dtype="float16", block_cache=0.25, compute_memory=None)
    report, _, cache = _run(model, cfg)
    layers = model.config.num_hidden_layers
    per_layer = report.tier_kv_bytes // layers  # one layer's file (records padded to 256 B, whole blocks)
    tails = layers * BATCH * model.config.num_key_value_heads * 4096
    assert report.parts["tier_buffers"] <= tails + 3 * per_layer  # read buffer (doubling) + one staging buffer
    blocks = per_layer // 4096
    assert report.parts["block_cache"] == layers * math.ceil(0.25 * blocks) * 4096


def test_infinigen_reports_its_partial_keys_dense_layers_and_model_sized_state_apart():
    model = tiny_model("llama")
    cfg = InfiniGenConfig(budget=0.25, partial_ratio=0.5, calibration_tokens=64, kv_dtype="float16")
    report, summary, _ = _run(model, cfg)
    a = get_adapter(model)
    assert report.parts["speculation_state"] == summary["selector_bytes"] > 0
    # the dense layers are kept in the KV's storage dtype (fp16), preallocated for max_length
    assert report.parts["dense_layers"] == cfg.dense_layers * BATCH * (PROMPT + NEW) * _kv_row(model, 2)
    assert report.selector_weight_bytes > 0  # the calibrated projections: per model, apart
    assert report.weight_bytes == sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    offloaded = a.num_layers - cfg.dense_layers
    assert report.tier_kv_bytes >= offloaded * BATCH * (PROMPT + NEW - 1) * _kv_row(model, 2)


def test_a_closed_cache_reports_what_it_kept_when_it_closed():
    model = tiny_model("llama")
    report, _, cache = _run(model, InfiniGenConfig(policy="full", tier="disk", kv_dtype="float16"), close=True)
    assert cache.closed and cache.memory() == report and report.compute_kv_bytes > 0
    assert cache.summary()["compute_kv_bytes"] == report.compute_kv_bytes


def test_sliding_window_layers_count_their_window_for_dense_and_for_the_cache():
    model = tiny_variant("gemma3")
    report, _, cache = _run(model, InfiniGenConfig(policy="full", kv_dtype="float16", compute_memory=None))
    a = get_adapter(model)
    local = [i for i in range(a.num_layers) if a.is_local(i)]
    assert local and len(local) < a.num_layers
    positions = PROMPT + NEW - 1
    row = 2 * a.num_kv_heads * a.head_dim * 2
    want = sum(BATCH * (min(positions, WINDOW - 1) if i in local else positions) * row for i in range(a.num_layers))
    assert report.dense_kv_bytes == want
    assert 0 < report.parts["local_layers"] <= len(local) * BATCH * WINDOW * 2 * a.num_kv_heads * a.head_dim * 4


def test_generate_json_carries_compute_and_dense_kv_bytes(tiny_model_dir, capsys):
    rc, out, _ = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "abc " * 40, "--max-new-tokens", "3",
        "--policy", "full", "--tier", "disk", "--json", "--quiet",
    )  # fmt: skip
    assert rc == 0
    result = json.loads(out)
    memory = result["memory"]
    assert result["compute_kv_bytes"] == memory["compute_kv_bytes"] == sum(memory["compute_parts"].values()) > 0
    assert result["dense_kv_bytes"] == memory["dense_kv_bytes"] > 0
    assert memory["tier"] == "disk" and memory["tier_kv_bytes"] > 0


def test_generate_prints_what_stays_with_the_compute(tiny_model_dir, capsys):
    rc, out, _ = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "abc " * 40, "--max-new-tokens", "3",
        "--policy", "full", "--quiet",
    )  # fmt: skip
    assert rc == 0
    line = next(x for x in out.splitlines() if "kept with the compute" in x)
    assert "of dense's KV" in line and "in the ram tier" in line


def test_more_than_dense_at_a_short_context_says_why(tiny_model_dir, capsys):
    """A short prompt on the disk tier: whole blocks and the read buffer outweigh dense's few
    positions of KV, and the line says so (the share alone reads like a fault)."""
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "abc", "--max-new-tokens", "3",
        "--policy", "full", "--tier", "disk", "--quiet",
    )  # fmt: skip
    assert rc == 0, err
    line = next(x for x in out.splitlines() if "kept with the compute" in x)
    share = float(re.search(r"= ([0-9.]+)% of dense's KV", line).group(1))
    assert share > 100 and "over 100% as these parts have minimum sizes (" in line
    assert "whole disk blocks and read buffers" in line and "the share falls as the context grows" in line
    assert re.search(r"that a context of \d+ positions does not fill", line)


def test_a_share_under_dense_needs_no_reason():
    memory = {
        "compute_kv_bytes": 50, "dense_kv_bytes": 100, "compute_share_of_dense_kv": 0.5, "tier_kv_bytes": 0,
        "compute_parts": {"transfer_buffers": 50}, "tier": "ram", "positions": 4000,
    }  # fmt: skip
    assert (
        memory_line(memory) == "kept with the compute: 50.0 B = 50.0% of dense's KV (100.0 B) (transfer buffers 50.0 B)"
    )
    over = memory_line({**memory, "compute_kv_bytes": 150, "compute_share_of_dense_kv": 1.5, "positions": 9})
    assert "over 100% as these parts have minimum sizes (transfer buffers) that a context of 9 positions" in over
    dense = {**memory, "compute_kv_bytes": 101, "compute_share_of_dense_kv": 1.01, "tier": "compute"}
    assert "over 100%" not in memory_line(dense)  # dense's room preallocated for the generation: nothing to explain


@pytest.mark.parametrize("policy", ["h2o", "quest", "streaming"])
def test_every_selector_reports_its_state(policy):
    model = tiny_model("llama")
    report, summary, _ = _run(model, InfiniGenConfig(policy=policy, budget=0.25, kv_dtype="float16"))
    assert report.compute_kv_bytes == summary["compute_kv_bytes"] > 0
    assert report.parts["speculation_state"] == summary["selector_bytes"]
