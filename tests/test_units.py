"""Selection in units: every row of a chosen unit is attended, each KV head's units its own or one
choice for a token's heads, and the speculation over the units' moments (`unit_moments`) scores
what a plain loop over the unit's keys says. Each rule's ranking is tested in test_speculate.py
and test_kernels.py; here the whole cache runs in units on a tiny random model."""

import math

import pytest
import torch

from conftest import VOCAB, left_padded_batch, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.select.unit_moments import UnitMoments
from test_sparse import _forced, masked_replay, selections_by_step

BLOCK = 4


def test_unit_moments_estimate_each_units_log_mass_to_second_order():
    """log n + q.m + 1/2 sum_c q_c^2 var_c per query head and unit (m, var over the unit's real
    positions), appended as a prefill and decode steps across unit boundaries, left padding excluded."""
    torch.manual_seed(0)
    b, hkv, g, t, c, scaling = 2, 2, 3, 37, 5, 0.5
    keys = torch.randn(b, hkv, t, c)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :5] = False
    units = UnitMoments(BLOCK)
    units.append(keys[:, :, :18], valid[:, :18])  # a prefill ending inside a unit
    for p in range(18, 23):  # decode steps, one position each, across a unit boundary
        units.append(keys[:, :, p : p + 1], valid[:, p : p + 1])
    units.append(keys[:, :, 23:], valid[:, 23:])
    q = torch.randn(b, hkv * g, c)
    for how in ("mean", "moments"):
        s, ok = units.scores(q, scaling, how)
        for row in range(b):
            for h in range(hkv * g):
                for j in range(-(-t // BLOCK)):
                    pos = [p for p in range(j * BLOCK, min(j * BLOCK + BLOCK, t)) if valid[row, p]]
                    if not pos:
                        assert not ok[row, j] and s[row, h, j] == -math.inf
                        continue
                    k = keys[row, h // g, pos].double()
                    qs = q[row, h].double() * scaling
                    want = math.log(len(pos)) + float(qs @ k.mean(0))
                    if how == "moments":
                        want += 0.5 * float(qs**2 @ k.var(0, unbiased=False))
                    assert s[row, h, j].item() == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(unit_score="mass"),
        dict(unit_score="top2", unit_heads="shared"),
        dict(unit_keys="moments"),
        dict(unit_keys="moments", unit_heads="shared"),
    ],
)
def test_infinigen_in_units_attends_whole_units_and_only_them(knobs):
    """Through the cache: each step attends exactly its selection (the masked replay), every
    selected position's unit is selected whole wherever its rows are real, and shared units are
    the same positions for every KV head."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=40, pad=9)
    config = InfiniGenConfig(policy="infinigen", budget=0.3, block_tokens=BLOCK, calibration_tokens=64, **knobs)
    with attach(model, config, progress=False) as session:
        cache = session.new_cache(trace=True)
        got = _forced(model, ids, mask, cache, 3)
    record = selections_by_step(cache.trace)
    real = torch.cat([mask.bool(), torch.ones(mask.shape[0], 8, dtype=torch.bool)], 1)  # decoded tokens are real
    for past, layers in record.items():
        for layer, (indices, valid) in layers.items():
            for row in range(indices.shape[0]):
                chosen = [
                    {int(p) for p, v in zip(indices[row, h], valid[row, h]) if v} for h in range(indices.shape[1])
                ]
                for h, picked in enumerate(chosen):
                    for p in picked:
                        start = p - p % BLOCK
                        whole = {q for q in range(start, min(start + BLOCK, past)) if real[row, q]}
                        assert whole <= picked, (past, layer, row, h, p)
                if knobs.get("unit_heads") == "shared":
                    assert all(s == chosen[0] for s in chosen), (past, layer, row)
    fractions = [p["fetched_fraction"] for p in cache.summary()["per_layer"] if p["speculated"]]
    assert fractions and max(fractions) < 0.9
    torch.testing.assert_close(got, masked_replay(model, ids, mask, record, 3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("how", ["mean", "moments"])
@pytest.mark.parametrize("aggregation", ["max", "mass"])
def test_the_kernel_ranks_unit_moments_as_the_tensor_path_does(how, aggregation):
    """The summaries scored by the selection kernel (2c + 1 channels, the query [q, q^2 / 2, 1])
    choose as many units as the tensor path, and none it leaves scores better than one it takes,
    up to rounding."""
    import infinigen.kernels as kernels
    from infinigen.speculate import aggregate_group, select_units

    if not kernels.available():
        pytest.skip("no C compiler: the tensor path alone runs")
    torch.manual_seed(1)
    b, hkv, g, t, c, scaling, budget = 2, 3, 3, 700, 6, 0.4, 0.1
    keys = torch.randn(b, hkv, t, c)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :40] = False
    units = UnitMoments(16)
    units.append(keys, valid)
    q = torch.randn(b, hkv * g, c)
    n_units, held = units.units_held(t)
    ok = held[:, None, :].expand(b, hkv, n_units)
    s, _ = units.scores(q, scaling, how)
    ref_scores = aggregate_group(s, ok, hkv, aggregation)
    pos_valid = valid[:, None, :].expand(b, hkv, t)
    want = select_units(ref_scores, ok, pos_valid, 16, math.inf, budget)
    chosen, counts = kernels.select(units.summary.full, n_units, units.query(q, scaling, how), ok, aggregation,
                                    math.inf, budget, None, 1)  # fmt: skip
    for row in range(b):
        for h in range(hkv):
            got = {int(u) for u in chosen[row, h, : counts[row, h]]}
            ref = {int(p) // 16 for p, v in zip(want.indices[row, h], want.valid[row, h]) if v}
            assert len(got) == len(ref)
            left = [u for u in range(n_units) if u not in got and ok[row, h, u]]
            worst_in = min(ref_scores[row, h, u].item() for u in got)
            assert all(ref_scores[row, h, u].item() <= worst_in + 1e-4 for u in left)


def test_the_disk_tier_selects_in_its_read_unit_and_reads_fewer_blocks_than_row_by_row(tmp_path):
    """Left unset, the unit is the tier's read unit: on disk a block's positions of one KV head,
    with the unit defaults (budget `UNIT_BUDGET`, no correction), every unit chosen whole, and
    fewer disk bytes read per row attended than row by row at the same budget (whose rows each
    cost a block); on the RAM tier the unit is a row and the settings stay as given."""
    from infinigen.select import UNIT_BUDGET
    from infinigen.storage import read_unit

    model = tiny_model("llama")
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 200))
    d = model.config.hidden_size // model.config.num_attention_heads
    unit = read_unit("disk", "native", d, torch.float32, tmp_path)
    assert unit == 4096 // (2 * d * 4) or unit > 1  # a 4 KiB block, or the file system's larger one
    disk = InfiniGenConfig(calibration_tokens=64, kv_dtype="float32", tier="disk", kv_dir=str(tmp_path))
    amplification = {}
    with attach(model, disk, progress=False) as session:
        for name, config in (("default", disk), ("rows", disk.replace(block_tokens=1, budget=UNIT_BUDGET))):
            cache = session.new_cache(config, max_length=ids.shape[1] + 4, trace=True)
            model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
            amplification[name] = cache.summary()["read_amplification"]
            cache.close()
            if name == "default":
                resolved = (cache.config.block_tokens, cache.config.budget, cache.config.correction)
                assert resolved == (unit, UNIT_BUDGET, 0.0)
                for past, layers in selections_by_step(cache.trace).items():
                    for indices, valid in layers.values():
                        for h in range(indices.shape[1]):
                            picked = set(indices[0, h][valid[0, h]].tolist())
                            whole = [set(range(p - p % unit, min(p - p % unit + unit, past))) for p in picked]
                            assert picked and all(w <= picked for w in whole)
        ram = session.new_cache(disk.replace(tier="ram", kv_dir=None))
        assert (ram.config.block_tokens, ram.config.budget, ram.config.correction) == (1, None, None)
        explicit = session.new_cache(disk.replace(budget=0.3))
        assert (explicit.config.block_tokens, explicit.config.budget) == (unit, 0.3)
    assert amplification["default"] < amplification["rows"] / 2
