"""`infinigen bench decode` end to end on a tiny hybrid model folder: a row reports what the
sliding-window layers keep as the cache counts it (in the KV's storage dtype), beside dense's."""

import json

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from conftest import _HYBRID, WINDOW, _byte_tokenizer, run_cli
from infinigen.bench.decode import add_floors


def test_rows_report_the_local_windows_as_each_cache_keeps_them(tmp_path, capsys):
    tokenizer = _byte_tokenizer()
    torch.manual_seed(0)
    heads, head_dim = 2, 24
    cfg = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=len(_HYBRID),
        num_attention_heads=4, num_key_value_heads=heads, head_dim=head_dim, query_pre_attn_scalar=20,
        sliding_window=WINDOW, layer_types=_HYBRID, max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    folder = tmp_path / "tiny-gemma3"
    Gemma3ForCausalLM(cfg).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "bench"
    rc, said, err = run_cli(
        capsys, "bench", "decode", "--model", str(folder), "--contexts", "64", "--batches", "2", "--steps", "2",
        "--policies", "dense,dense-hf,full", "--out", str(out),
    )  # fmt: skip
    assert rc == 0, err
    assert "every offloading policy aiming at 12.5% of dense's KV with the compute (compute_memory auto" in said
    rows = {r["policy"]: r for r in json.loads((out / "bench_decode.json").read_text())["rows"]}
    local = _HYBRID.count("sliding_attention")
    window = 2 * 2 * heads * (WINDOW - 1) * head_dim  # K and V of every batch row's window, per byte of a value
    assert rows["dense"]["local_kv_bytes"] == local * window * 4  # as computed: fp32
    assert rows["full"]["local_kv_bytes"] == local * window * 2  # the KV's storage dtype: fp16
    assert rows["full"]["compute_parts"]["local_layers"] == rows["full"]["local_kv_bytes"]
    assert rows["dense-hf"]["local_kv_bytes"] == local * window * 4  # transformers' cache: as computed
    assert all(r["correction_ms_per_step"] == 0.0 for r in rows.values())  # nothing here tops up
    assert rows["dense-hf"]["plan"] is None and rows["full"]["plan"]["compute_memory"] == "auto"  # the default aim
    for r in rows.values():  # every row knows its bound
        assert 0 <= r["compute_floor_ms"] <= r["step_ms_mean"] and 0 < r["efficiency"] <= 1
    assert rows["dense"]["read_floor_ms"] == 0.0 and rows["full"]["read_floor_ms"] > 0
    # H2O watches its prefill: the saved prefill carries the prompt's attention column sums for it
    rc, said, err = run_cli(
        capsys, "bench", "decode", "--model", str(folder), "--contexts", "64", "--batches", "2", "--steps", "2",
        "--policies", "h2o", "--out", str(out),
    )  # fmt: skip
    assert rc == 0, err
    (row,) = json.loads((out / "bench_decode.json").read_text())["rows"]
    assert row["policy"] == "h2o" and row["bytes_read_per_token"] > 0
    rc, said, err = run_cli(
        capsys, "bench", "decode", "--model", str(folder), "--contexts", "64", "--batches", "2", "--steps", "2",
        "--policies", "full", "--compute-memory", "1000%", "--out", str(out),
    )  # fmt: skip
    assert rc == 0, err
    assert "every offloading policy within compute_memory 1000%" in said
    (row,) = json.loads((out / "bench_decode.json").read_text())["rows"]
    assert row["plan"]["compute_memory"] == "1000%"  # as written, and what it came to for this row
    assert (
        row["compute_kv_bytes"] <= row["plan"]["compute_memory_bytes"] <= 11 * row["dense_kv_bytes"]
    )  # planned: +1 position


def test_floors_are_the_step_less_its_waits_and_its_bytes_at_full_fetchs_rate():
    full = {
        "batch": 2, "bytes_read_per_token": 1000.0, "bytes_from_ram_per_token": 0.0, "transfer_ms_per_step": 4.0,
        "step_ms_mean": 10.0, "wait_ms_per_step": 6.0, "correction_ms_per_step": 0.0,
    }  # fmt: skip
    row = {
        "batch": 2, "bytes_read_per_token": 300.0, "bytes_from_ram_per_token": 50.0, "transfer_ms_per_step": 3.0,
        "step_ms_mean": 8.0, "wait_ms_per_step": 1.0, "correction_ms_per_step": 2.0,
    }  # fmt: skip
    add_floors(row, full)
    # full fetch read 2 x 1000 bytes in 4 ms of transfers: 500 bytes a ms; the row reads (300 - 50) x 2 bytes
    assert row["read_floor_ms"] == pytest.approx(1.0)
    assert row["compute_floor_ms"] == pytest.approx(5.0)  # 8 - 1 waited - 2 correcting
    assert row["efficiency"] == pytest.approx(5.0 / 8.0)
    add_floors(full, full)
    assert full["read_floor_ms"] == pytest.approx(4.0) and full["efficiency"] == pytest.approx(0.4)
    alone = dict(row)
    add_floors(alone, None)  # no full fetch in the run: no read floor
    assert alone["read_floor_ms"] is None and alone["efficiency"] == pytest.approx(5.0 / 8.0)


def test_a_saved_prefill_carries_the_column_sums_only_when_asked(tmp_path):
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from infinigen.bench.decode import save_prefill
    from infinigen.generation import prompt_column_sums

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )).eval()  # fmt: skip
    ids = torch.randint(0, 64, (1, 40))
    save_prefill(model, ids, tmp_path / "plain.safetensors", torch.float16)
    save_prefill(model, ids, tmp_path / "watched.safetensors", torch.float16, column_sums=True)
    with safe_open(tmp_path / "plain.safetensors", framework="pt") as f:
        assert not [k for k in f.keys() if k.endswith(".sums")]
    expected = prompt_column_sums(model, ids)
    with safe_open(tmp_path / "watched.safetensors", framework="pt") as f:
        for i in range(2):
            torch.testing.assert_close(f.get_tensor(f"layer.{i}.sums"), expected[i])
            assert float(f.get_tensor(f"layer.{i}.sums").sum()) == pytest.approx(40 * 4, rel=1e-4)  # rows sum to 1
