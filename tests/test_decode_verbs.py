"""The decode path's small verbs: one rule each for the scaling, the fetched fraction and the
roles; a transfer that is issued, settled and waited on; recall measured by an observer that
evaluation sets, never by the runtime itself."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import left_padded_batch, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.attention import attention_scaling
from infinigen.compat import cache_kwargs
from infinigen.measure.recall import RecallObserver
from infinigen.roles import Role
from infinigen.speculate import Selection
from infinigen.storage import RamTier, TransferStats
from infinigen.transfer import Planned, Transfer, fetched_fraction


def test_the_default_scaling_is_one_over_the_root_of_the_head_size():
    q = torch.zeros(1, 2, 1, 16)
    assert attention_scaling(q, None) == 16**-0.5
    assert attention_scaling(q, 0.3) == 0.3


def test_the_fetched_fraction_is_of_the_real_context():
    valid = torch.tensor([[[True, True, False], [True, False, False]], [[True, True, True], [True, True, True]]])
    sel = Selection(torch.zeros_like(valid, dtype=torch.long), valid)  # counts [[2, 1], [3, 3]]
    assert fetched_fraction(sel, 10).item() == pytest.approx((2 + 1 + 3 + 3) / 4 / 10)
    assert fetched_fraction(sel, 0).item() == pytest.approx(9 / 4)  # an empty context counts as one
    real = torch.tensor([4, 6])  # the first row's context is partly padding
    assert fetched_fraction(sel, real).item() == pytest.approx((2 / 4 + 1 / 4 + 3 / 6 + 3 / 6) / 4)


def test_roles_are_their_names():
    assert Role.SELECT == "select" and json.dumps(Role.FETCH_ALL) == '"fetch_all"' and f"{Role.LOCAL}" == "local"
    assert [r for r in Role if r.offloaded] == [Role.FETCH_ALL, Role.SELECT, Role.WINDOW]
    assert [r for r in Role if r.sliding] == [Role.LOCAL, Role.WINDOW]
    assert InfiniGenConfig(windows_on_compute=False).layer_role(0, local=True) == "window"
    cfg = InfiniGenConfig(dense_layers=2)
    assert [cfg.layer_role(i) for i in range(3)] == [Role.COMPUTE, Role.COMPUTE, Role.SELECT]
    assert cfg.layer_role(5, local=True) is Role.LOCAL
    assert InfiniGenConfig(policy="full").layer_role(0) is Role.FETCH_ALL


def test_a_transfer_is_issued_settled_and_waited_on():
    tier = RamTier(1, 2, 4, torch.float32, TransferStats())
    tier.append(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    out = (torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4))
    every = Transfer.every_row(tier, 5, torch.device("cpu"), torch.float32, out, issued_at=3)
    got = every.wait()
    assert every.issued_at == 3 and got.selection is None and got.fraction == 1.0 and got.waited >= 0
    assert torch.equal(got.rows[0], tier.peek_all()[0][:, :, :5]) and got.rows[0].data_ptr() == out[0].data_ptr()

    sel = Selection(torch.tensor([[[1, 4], [0, 2]]]), torch.ones(1, 2, 2, dtype=torch.bool))

    def plan() -> Planned:
        rows = tier.gather_async(sel.indices, sel.valid, torch.device("cpu"), torch.float32)
        return Planned(rows, sel, 0.4)

    with ThreadPoolExecutor(1) as prefetch:
        ahead = Transfer.issue(plan, issued_at=1, executor=prefetch)
        ahead.settle()  # nothing of it reads the tier any more
        got = ahead.wait()
    assert got.selection is sel and got.fraction == 0.4
    assert torch.equal(got.rows[0][0, 0], tier.peek_all()[0][0, 0, [1, 4]])
    assert Transfer.issue(plan, issued_at=2, executor=None).work.done()  # no prefetch thread: run now


class _Watch:
    """An observer that only records what it is shown."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_attend(self, layer, query, selection, keys, real, scaling) -> None:
        self.seen.append((layer, query.shape, selection.indices.shape[:2], keys.shape, real.shape, scaling))

    def report(self, layer: int) -> dict:
        return {"recall": float(sum(s[0] == layer for s in self.seen))}


def _generate(model, ids, mask, cache, n=4):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **cache_kwargs(model, cache), pad_token_id=0
    )  # fmt: skip


def test_recall_is_measured_by_the_observer_evaluation_sets():
    model = tiny_model("llama")
    ids, mask = left_padded_batch(length=30)
    cfg = InfiniGenConfig(alpha=1.0, calibration_tokens=64, min_tokens=2)
    with attach(model, cfg, progress=False) as session:
        plain = session.new_cache()
        _generate(model, ids, mask, plain)
        watched = session.new_cache()
        watched.observer = watch = _Watch()
        _generate(model, ids, mask, watched)
        measured = session.new_cache(cfg.replace(measure_recall=True))  # the session attaches the observer
        assert isinstance(measured.observer, RecallObserver)
        _generate(model, ids, mask, measured)
    s_plain, s_watched, s_measured = plain.summary(), watched.summary(), measured.summary()
    selecting = [p["layer"] for p in s_plain["per_layer"] if p["speculated"]]
    assert selecting and s_plain["recall"] is None and all(p["recall"] is None for p in s_plain["per_layer"])
    # Shown once per decode step of each selecting layer, with every stored key of the past.
    steps = s_watched["decode_steps"]
    assert sorted({s[0] for s in watch.seen}) == selecting and len(watch.seen) == steps * len(selecting)
    b, h, hkv = ids.shape[0], model.config.num_attention_heads, model.config.num_key_value_heads
    d = getattr(model.config, "head_dim", None) or model.config.hidden_size // h
    first = [s for s in watch.seen if s[0] == selecting[0]][0]
    assert first[1:] == ((b, h, 1, d), (b, hkv), (b, hkv, ids.shape[1], d), (b, ids.shape[1]), d**-0.5)
    assert [p["recall"] for p in s_watched["per_layer"] if p["speculated"]] == [float(steps)] * len(selecting)
    # Watching changes nothing else; the recall of a selection is a share of the attention mass.
    drop = ("recall", "wait_seconds", "speculation_seconds", "correction_seconds", "per_layer")
    assert {k: v for k, v in s_plain.items() if k not in drop} == {k: v for k, v in s_measured.items() if k not in drop}
    assert 0.0 < s_measured["recall"] <= 1.0 + 1e-6
    assert all(0.0 < p["recall"] <= 1.0 + 1e-6 for p in s_measured["per_layer"] if p["speculated"])
