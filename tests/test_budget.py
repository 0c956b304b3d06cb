"""The plan of what stays with the compute (`infinigen.budget`): its estimate against what the cache
then measures (`cache.memory()`), and `compute_memory`: fitted by giving things up, or refused
before any KV is computed."""

import math

import pytest
import torch

from conftest import VOCAB, run_cli, tiny_model
from infinigen import InfiniGenConfig, attach, budget
from infinigen.budget import MemoryBudgetError, Request, estimate
from infinigen.compat import cache_kwargs
from infinigen.config import ConfigError
from infinigen.memory import dense_kv_bytes
from infinigen.models import get_adapter
from infinigen.validation import parse_size

P, N, B = 150, 20, 2
SLACK = 64 << 10  # the disk tier's read buffer grows by doubling: the estimate takes its bound


def _ids(batch=B, length=P):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(5))


def _generate(model, cfg, rows=B, new=N, **cache_args):
    ids = _ids(rows)
    with attach(model, cfg, progress=False) as session:
        with session.new_cache(**cache_args) as cache:
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), max_new_tokens=new,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            return cache.memory(), cache.plan, cache.summary()


CASES = [
    ("dense", "ram", {}),
    ("full", "ram", {}),
    ("full", "disk", {}),
    ("infinigen", "ram", {}),
    ("infinigen", "disk", {"partial_format": "int8"}),
    ("infinigen", "disk", {"partial_format": "int4", "correction": 0.05}),
    ("infinigen", "disk", {"fetch_chunk": 16, "dense_layers_on_compute": False}),
    ("infinigen", "disk", {"read_chunk": "8KiB"}),
    ("full", "disk", {"fetch_chunk": 16}),
    ("quest", "disk", {}),
    ("h2o", "ram", {}),
    ("streaming", "disk", {}),
]


@pytest.mark.parametrize("policy, tier, extra", CASES)
def test_the_estimate_is_never_below_what_the_cache_keeps_and_close_to_it(policy, tier, extra):
    cfg = InfiniGenConfig(policy=policy, tier=tier, budget=0.25, calibration_tokens=64, kv_dtype="float16", **extra)
    measured, plan, _ = _generate(tiny_model("llama"), cfg, max_length=P + N, batch=B)
    for part, held in measured.parts.items():
        assert held <= plan.parts[part], part
        assert plan.parts[part] <= 1.05 * held + (SLACK if part == "tier_buffers" else 128), part


def test_the_estimate_of_a_sliding_window_model_counts_windows(tiny_window_model):
    cfg = InfiniGenConfig(policy="full", kv_dtype="float16")
    measured, plan, _ = _generate(tiny_window_model, cfg, max_length=P + N, batch=B)
    assert measured.parts["local_layers"] <= plan.parts["local_layers"] <= 1.5 * measured.parts["local_layers"]


@pytest.mark.parametrize("policy, tier", [("full", "disk"), ("infinigen", "disk"), ("infinigen", "ram")])
def test_the_estimate_of_windows_read_from_the_tier(tiny_window_model, tmp_path, policy, tier):
    """Windows read back each step: nothing of them kept, a window's rows in the transfer buffers,
    a window's span in the disk tier's read buffer; the estimate holds to what is measured."""
    cfg = InfiniGenConfig(
        policy=policy, tier=tier, kv_dir=str(tmp_path), budget=0.25, calibration_tokens=64, kv_dtype="float16",
        windows_on_compute=False, compute_memory=None,
    )  # fmt: skip
    measured, plan, _ = _generate(tiny_window_model, cfg, max_length=P + N, batch=B)
    assert measured.parts["local_layers"] == 0 == plan.parts["local_layers"]
    # five tiers' tails here: the read buffer's doubling bound and the staging sized for every
    # position (the prompt is shorter) stand out more than on the four-layer model above
    for part, held in measured.parts.items():
        assert held <= plan.parts[part], part
        assert plan.parts[part] <= 1.05 * held + (2 * SLACK if part == "tier_buffers" else 128), part


def test_a_budget_reads_the_windows_from_the_tier_when_keeping_them_does_not_fit(tiny_window_model):
    """Sliding windows read back each step are a lossless step of the plan: a budget that only
    reading them back meets gets them read back, and the same greedy tokens as no budget."""
    base = InfiniGenConfig(budget=0.25, calibration_tokens=64, kv_dtype="float16", tier="ram", compute_memory=None)
    read_back = _needs(base.replace(windows_on_compute=False), tiny_window_model)
    assert read_back < _needs(base, tiny_window_model)
    ids = _ids()
    tokens = {}
    for memory in (str(read_back), None):
        with attach(tiny_window_model, base.replace(compute_memory=memory), progress=False) as session:
            with session.new_cache(max_length=P + N, batch=B) as cache:
                tokens[memory] = tiny_window_model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(tiny_window_model, cache), max_new_tokens=N,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip
                if memory is not None:
                    plan, measured = cache.plan, cache.memory()
    assert budget.WINDOWS in plan.changes and not plan.config.windows_on_compute
    assert measured.parts["local_layers"] == 0 and measured.compute_kv_bytes <= plan.total <= read_back
    assert torch.equal(tokens[str(read_back)], tokens[None])


@pytest.fixture
def tiny_window_model():
    from conftest import tiny_variant

    return tiny_variant("gemma3")


def _needs(cfg, model) -> int:
    from infinigen.select import make_selector  # noqa: F401  (the estimate below takes a built selector)

    with attach(model, cfg, progress=False) as session:
        sel = session.selector_for(cfg)
        return sum(estimate(cfg, get_adapter(model), sel, Request(B, P + N), torch.float32).values())


def test_a_budget_is_met_by_giving_up_block_cache_then_dense_layers_then_precision(monkeypatch):
    monkeypatch.setattr(budget, "PLANNED_FETCH_CHUNK", 8)  # a chunk the tiny context is much longer than
    model = tiny_model("llama")
    base = InfiniGenConfig(
        budget=0.25, calibration_tokens=64, kv_dtype="float16", tier="disk", block_cache=0.5, partial_format="kv"
    )
    chunked = base.replace(block_cache=0.0, fetch_chunk=8, dense_layers_on_compute=False)
    steps = [
        (_needs(base, model) - 8192, ["block cache 0.5 -> 0.4"], "kv"),
        (_needs(chunked, model), ["dense layers read from the tier", "block cache 0.5 -> 0"], "kv"),
        (
            _needs(chunked.replace(partial_format="int4"), model),
            ["dense layers read from the tier", "partial keys kv -> int4", "block cache 0.5 -> 0"],
            "int4",
        ),
    ]
    for limit, said, fmt in steps:
        cfg = base.replace(compute_memory=str(limit))
        measured, plan, summary = _generate(model, cfg, max_length=P + N, batch=B)
        assert plan.total <= limit and measured.compute_kv_bytes <= limit
        assert plan.config.partial_format == fmt
        changes = " ".join(plan.changes)
        assert all(s in changes for s in said), changes
        assert summary["plan"]["changes"] == list(plan.changes)
    assert measured.parts["dense_layers"] == 0
    with pytest.raises(MemoryBudgetError):  # one byte less than the leanest plan
        _generate(model, base.replace(compute_memory=str(steps[-1][0] - 1 - 8192)), max_length=P + N, batch=B)


def test_a_request_that_cannot_fit_is_refused_before_any_kv_is_computed():
    model = tiny_model("llama")
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    cfg = InfiniGenConfig(budget=0.25, calibration_tokens=64, kv_dtype="float16", compute_memory="4KiB")
    ids = _ids()
    with attach(model, cfg, progress=False):
        calls.clear()  # calibration ran forwards; the generation must run none
        with pytest.raises(MemoryBudgetError) as err:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                           pad_token_id=0)  # fmt: skip
    assert not calls
    text = str(err.value)
    assert "\n" not in text and "need at least" in text and "4.0 KiB" in text and f"{B} x {P + N}" in text


def test_a_cache_planned_for_fewer_rows_refuses_more():
    model = tiny_model("llama")
    cfg = InfiniGenConfig(policy="full", kv_dtype="float16", compute_memory="1GiB")
    with attach(model, cfg, progress=False) as session, session.new_cache(max_length=P + N, batch=1) as cache:
        with pytest.raises(MemoryBudgetError, match="planned for a batch of 1"):
            model.generate(
                input_ids=_ids(2), **cache_kwargs(model, cache), max_new_tokens=2, do_sample=False, pad_token_id=0
            )


def test_sizes_are_read_as_people_write_them():
    assert parse_size("512MiB") == 512 << 20 == parse_size("512M") == parse_size("512 mib")
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("800MB") == 800 * 10**6 and parse_size("4096") == 4096
    with pytest.raises(ConfigError, match="compute_memory must be auto, or a size"):
        InfiniGenConfig(compute_memory="lots")
    with pytest.raises(ConfigError):
        InfiniGenConfig(compute_memory="0")
    assert InfiniGenConfig(compute_memory="12.5%").compute_memory_bytes(8000) == 1000
    assert InfiniGenConfig(compute_memory="1GiB").compute_memory_bytes(8000) == 1 << 30
    for wrong in ("0%", "-5%", "lots%", "%"):
        with pytest.raises(ConfigError, match="or a share such as 12.5%"):
            InfiniGenConfig(compute_memory=wrong)


def test_the_command_line_refuses_a_request_over_the_budget_in_one_sentence(tiny_model_dir, capsys):
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "abc " * 40, "--max-new-tokens", "4",
        "--policy", "full", "--tier", "disk", "--compute-memory", "2KiB", "--quiet",
    )  # fmt: skip
    assert rc == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "need at least" in lines[0] and "compute_memory is 2.0 KiB" in lines[0]


def test_the_int4_baseline_holds_exactly_its_packed_kv_for_the_planned_length():
    """Sized at once for the generation (no doubling): what `bench capacity` counts against the
    budget for int4 is what its tier holds."""
    from infinigen.storage import row_bytes

    model = tiny_model("llama")
    measured, _, _ = _generate(model, InfiniGenConfig(policy="int4", kv_dtype="float16"), max_length=P + N, batch=B)
    a = get_adapter(model)
    assert measured.tier_kv_bytes == a.num_layers * B * a.num_kv_heads * (P + N) * row_bytes(
        "int4", a.head_dim, torch.float16
    )


def test_a_planned_chunk_is_the_largest_the_budget_leaves(monkeypatch):
    """Chunks only cost speed: between keeping the dense layers and the smallest chunk, the plan
    takes the largest chunk that still fits."""
    monkeypatch.setattr(budget, "PLANNED_FETCH_CHUNK", 8)
    model = tiny_model("llama")
    base = InfiniGenConfig(budget=0.25, calibration_tokens=64, kv_dtype="float16", tier="disk")
    smallest = _needs(base.replace(fetch_chunk=8, dense_layers_on_compute=False), model)
    kept = _needs(base, model)
    assert smallest < kept
    limit = (smallest + kept) // 2
    measured, plan, _ = _generate(model, base.replace(compute_memory=str(limit)), max_length=P + N, batch=B)
    chunk = plan.config.fetch_chunk
    assert 8 < chunk < P + N and f"chunks of {chunk} positions" in " ".join(plan.changes)
    assert measured.compute_kv_bytes <= plan.total <= limit
    assert _needs(plan.config.replace(fetch_chunk=chunk + 1, compute_memory=None), model) > limit


def test_a_share_is_of_what_dense_keeps_for_the_same_batch_and_positions():
    """`compute_memory` as a percentage: the plan's budget is that share of dense's KV for the
    request (in the KV's storage dtype), what the cache keeps stays within it, and a share too
    small is refused naming both."""
    model = tiny_model("llama")
    base = InfiniGenConfig(budget=0.25, calibration_tokens=64, kv_dtype="float16", tier="disk")
    dense = dense_kv_bytes(get_adapter(model), B, P + N, torch.float16)
    percent = math.ceil(100 * _needs(base, model) / dense) + 1  # a tiny model's buffers outweigh its KV
    cfg = base.replace(compute_memory=f"{percent}%")
    measured, plan, summary = _generate(model, cfg, max_length=P + N, batch=B)
    assert plan.budget == int(percent / 100 * dense) and summary["plan"]["compute_memory_bytes"] == plan.budget
    assert not plan.changes  # it fits as given
    assert measured.dense_kv_bytes <= dense and measured.compute_kv_bytes <= plan.total <= plan.budget
    with pytest.raises(MemoryBudgetError, match=r"\(1\.0 % of dense's KV\)"):
        _generate(model, cfg.replace(compute_memory="1%"), max_length=P + N, batch=B)


def test_a_budget_shrinks_the_disk_read_rounds_before_it_gives_up_the_dense_layers(monkeypatch):
    """Smaller rounds of disk reads only cost speed, and less of it than reading the dense layers
    from the tier: a budget that smaller rounds meet keeps the dense layers with the compute, with
    the largest rounds that fit."""
    monkeypatch.setattr(budget, "PLANNED_READ_CHUNK", 4096)
    model = tiny_model("llama")
    base = InfiniGenConfig(budget=0.25, calibration_tokens=64, kv_dtype="float16", tier="disk")
    smallest = _needs(base.replace(read_chunk="4KiB"), model)
    whole = _needs(base, model)
    assert smallest < whole  # the tiny layer's gather is over 4 KiB
    measured, plan, _ = _generate(model, base.replace(compute_memory=str(smallest)), max_length=P + N, batch=B)
    changes = " ".join(plan.changes)
    assert "disk read rounds 8MiB -> " in changes and "dense layers" not in changes, changes
    assert plan.config.dense_layers_on_compute and measured.parts["dense_layers"] > 0
    assert measured.compute_kv_bytes <= plan.total <= smallest
    rounds = plan.config.read_chunk_bytes
    assert (
        rounds >= 4096
        and _needs(plan.config.replace(read_chunk=str(rounds + 4096), compute_memory=None), model) > smallest
    )


def test_the_command_line_takes_a_share_and_says_what_it_came_to(tiny_model_dir, capsys):
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "abc " * 40, "--max-new-tokens", "4",
        "--policy", "full", "--tier", "disk", "--compute-memory", "1000%",
    )  # fmt: skip
    assert rc == 0, err
    line = next(x for x in out.splitlines() if "within compute_memory" in x)
    assert "within compute_memory 1000% of dense's KV = " in line and "(planned): nothing given up" in line
    rc, _, err = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "abc " * 40, "--max-new-tokens", "4",
        "--policy", "full", "--tier", "disk", "--compute-memory", "1%", "--quiet",
    )  # fmt: skip
    assert rc == 2 and "(1.0 % of dense's KV)" in err


def test_the_default_aims_at_a_share_of_dense_with_lossless_steps_only(monkeypatch):
    """compute_memory="auto": within `AUTO_SHARE` of dense's KV where the lossless steps reach it
    (the partial keys keep their precision even where a lower one would fit)."""
    from infinigen import config as config_module

    monkeypatch.setattr(budget, "PLANNED_FETCH_CHUNK", 8)  # a chunk the tiny context is much longer than
    model = tiny_model("llama")
    base = InfiniGenConfig(budget=0.25, calibration_tokens=64, kv_dtype="float16", tier="disk", partial_format="kv")
    assert base.compute_memory == "auto" and base.aims
    lean = base.replace(fetch_chunk=budget.PLANNED_FETCH_CHUNK, dense_layers_on_compute=False, read_chunk="256KiB")
    need, least = _needs(base, model), _needs(lean, model)
    dense = dense_kv_bytes(get_adapter(model), B, P + N, torch.float16)
    assert least < need
    monkeypatch.setattr(config_module, "AUTO_SHARE", f"{100 * (least + need) / 2 / dense}%")  # between the two
    measured, plan, summary = _generate(model, base, max_length=P + N, batch=B)
    assert plan.budget == (least + need) // 2 or abs(plan.budget - (least + need) / 2) <= 1
    assert plan.total <= plan.budget and measured.compute_kv_bytes <= plan.budget
    assert plan.config.partial_format == "kv" and summary["plan"]["compute_memory"] == "auto"
    assert not any("not met" in c for c in plan.changes)


def test_a_default_aim_that_cannot_be_met_takes_the_leanest_lossless_plan_and_says_so(monkeypatch):
    """The tiny model's buffers outweigh its KV: no plan reaches 12.5 %. The default does not
    refuse; it takes the leanest lossless plan, names the miss, and decodes what no budget does."""
    monkeypatch.setattr(budget, "PLANNED_FETCH_CHUNK", 8)
    model = tiny_model("llama")
    base = InfiniGenConfig(budget=0.25, calibration_tokens=64, kv_dtype="float16", tier="disk", partial_format="kv")
    tokens = {}
    for memory in ("auto", None):
        with attach(model, base.replace(compute_memory=memory), progress=False) as session:
            with session.new_cache(max_length=P + N, batch=1) as cache:  # planned for 1 row, given 2
                ids = _ids()
                tokens[memory] = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), max_new_tokens=8,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip
                if memory == "auto":
                    plan, measured = cache.plan, cache.memory()
    assert plan.config.partial_format == "kv" and not plan.config.dense_layers_on_compute
    assert plan.config.fetch_chunk == budget.PLANNED_FETCH_CHUNK and plan.config.block_cache == 0
    assert plan.changes[-1].startswith("aim 12.5 % of dense's KV not met: at least ")
    assert measured.parts["dense_layers"] == 0
    assert torch.equal(tokens["auto"], tokens[None])  # lossless: the same greedy tokens


def test_the_default_aim_plans_nothing_for_a_policy_that_keeps_the_kv_with_the_compute():
    _, plan, _ = _generate(tiny_model("llama"), InfiniGenConfig(policy="dense"), max_length=P + N, batch=B)
    assert plan.budget is None and plan.changes == ()


def test_the_command_line_says_the_default_aim_and_takes_none_and_default(tiny_model_dir, capsys):
    run = ("generate", "--model", str(tiny_model_dir), "--prompt", "abc " * 40, "--max-new-tokens", "4")
    rc, out, err = run_cli(capsys, *run, "--policy", "full", "--tier", "disk")
    assert rc == 0, err
    line = next(x for x in out.splitlines() if "aiming at" in x)
    assert "aiming at 12.5% of dense's KV = " in line and "(compute_memory auto, planned): " in line
    assert "not met" in line  # the tiny model's buffers outweigh its KV
    rc, out, err = run_cli(capsys, *run, "--policy", "full", "--tier", "disk", "--compute-memory", "none")
    assert rc == 0, err
    assert "aiming at" not in out and "within compute_memory" not in out
    rc, out, err = run_cli(capsys, *run, "--policy", "full", "--tier", "disk", "--compute-memory", "default")
    assert rc == 0 and "aiming at 12.5%" in out, err
