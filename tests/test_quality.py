"""The quality machinery against independent references: the calibrated spread of a budget
(exhaustive search), the correction's top-up and the oracle recall curve (plain loops), greedy
decoding by teacher forcing (the step-by-step decode path), RULER's offline stand-ins and the
genre texts."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from conftest import VOCAB, tiny_model
from infinigen import InfiniGenConfig, attach
from infinigen.compat import cache_kwargs
from infinigen.eval.datasets import DatasetMissingError, code_text, load_text
from infinigen.eval.ruler import TASKS, riemann_zeta, ruler_score, split_sentences
from infinigen.eval.suite import EvalRunner, EvalSettings
from infinigen.skew.tables import allocate_budgets, oracle_recall_curve
from infinigen.speculate import selection_mask, top_up


# ---------------------------------------------------------------------- budgets across layers
def test_allocated_budgets_match_an_exhaustive_search():
    """Three layers with concave recall curves: the greedy spread reaches the summed recall of
    the best split found by trying every split on the same step grid, and keeps the mean."""
    grid = torch.linspace(0.01, 1.0, 100)
    curves = {
        0: 1 - (1 - grid) ** 12,  # sharp: a little budget holds most of the mass
        1: 1 - (1 - grid) ** 2,  # flat
        2: 1 - (1 - grid) ** 5,
    }
    budget = 0.2
    got = allocate_budgets(curves, grid, budget, floor_share=0.25)
    assert sum(got.values()) / 3 == pytest.approx(budget, rel=1e-9)
    assert min(got.values()) >= 0.25 * budget - 1e-9

    def recall(i, f):
        return float(torch.from_numpy(__import__("numpy").interp([f], grid.numpy(), curves[i].numpy()))[0])

    low, step = 0.25 * budget, 0.0025
    units = round(3 * (budget - low) / step)
    best = max(
        sum(recall(i, low + n * step) for i, n in enumerate(split))
        for split in itertools.product(range(units + 1), repeat=2)
        if sum(split) <= units
        for split in [(*split, units - sum(split))]
    )
    assert sum(recall(i, f) for i, f in got.items()) >= best - 2e-3
    assert got[1] > got[0], "the flat layer needs more positions than the sharp one for the same gain"


def test_uniform_curves_get_the_budget_everywhere():
    grid = torch.linspace(0.01, 1.0, 50)
    curve = 1 - (1 - grid) ** 4
    got = allocate_budgets({2: curve, 3: curve.clone(), 4: curve.clone()}, grid, 0.1)
    assert all(f == pytest.approx(0.1, abs=0.01) for f in got.values())


def test_oracle_recall_curve_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    h, hkv, t, d = 4, 2, 30, 8
    q, k = torch.randn(h, t, d, generator=gen), torch.randn(hkv, t, d, generator=gen)
    grid = torch.tensor([0.05, 0.2, 0.5, 1.0])
    positions = torch.tensor([10, 20, 29])
    got = oracle_recall_curve(q, k, positions, 0.5, grid)
    want = torch.zeros(len(grid), dtype=torch.float64)
    for p in positions.tolist():
        for j, f in enumerate(grid.tolist()):
            count = min(max(math.ceil(f * p), 1), p)
            total = 0.0
            for kv in range(hkv):
                heads = range(kv * (h // hkv), (kv + 1) * (h // hkv))
                probs = {hh: torch.softmax((k[kv, :p] @ q[hh, p]) * 0.5, -1) for hh in heads}
                group = sum(probs.values())
                top = sorted(range(p), key=lambda i: -float(group[i]))[:count]
                total += sum(float(probs[hh][top].sum()) for hh in heads)
            want[j] += total / h
    torch.testing.assert_close(got.double(), want / len(positions), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------- speculate, then correct
def test_top_up_adds_the_best_positions_the_selection_missed():
    gen = torch.Generator().manual_seed(1)
    b, hkv, t = 2, 3, 20
    scores = torch.randn(b, hkv, t, generator=gen)
    valid = torch.rand(b, hkv, t, generator=gen) > 0.2
    chosen = (torch.rand(b, hkv, t, generator=gen) > 0.6) & valid
    count = torch.tensor([[0, 2, 5], [3, 50, 1]])
    got = selection_mask(top_up(scores.masked_fill(~valid, -math.inf), valid, chosen, count), t)
    for i in range(b):
        for j in range(hkv):
            open_ = [p for p in range(t) if valid[i, j, p] and not chosen[i, j, p]]
            best = sorted(open_, key=lambda p: -float(scores[i, j, p]))[: int(count[i, j])]
            assert set(torch.nonzero(got[i, j]).flatten().tolist()) == set(best)


def test_top_up_breaks_ties_at_the_cut_earliest_first():
    """Ties at the count-th best fill the rest of the count earliest first, as in the selection
    (so the C kernel and the tensor path choose the same rows), never more than the count."""
    scores = torch.tensor([[[1.0, 2.0, 1.0, 3.0, 1.0, 1.0]]])
    valid = torch.ones(1, 1, 6, dtype=torch.bool)
    chosen = torch.tensor([[[False, False, True, False, False, False]]])
    got = top_up(scores, valid, chosen, torch.tensor([[3]]))
    assert got.counts.tolist() == [[3]] and got.indices[0, 0].tolist() == [0, 1, 3]


# ---------------------------------------------------------------------- greedy by teacher forcing
@pytest.mark.parametrize(
    "cfg",
    [
        InfiniGenConfig(alpha=math.inf, budget=0.2, calibration_tokens=64),
        InfiniGenConfig(policy="h2o", budget=0.2),
        InfiniGenConfig(policy="quest", budget=0.25, page_tokens=4),
    ],
    ids=["infinigen", "h2o", "quest"],
)
def test_greedy_by_teacher_forcing_equals_greedy_decoding(cfg):
    """`policy_greedy` (Jacobi rounds of forced runs from a guess) emits exactly the tokens
    that greedy decoding through the cache emits, from a wrong guess too."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(5))
    n = 10
    with attach(model, cfg, progress=False) as session, session.new_cache() as cache:
        want = model.generate(input_ids=ids, **cache_kwargs(model, cache), max_new_tokens=n, do_sample=False)[0, 48:]
    runner = EvalRunner(model, None, EvalSettings(), progress=False)
    with runner.ev:
        prefix = runner.ev.prefill(ids)
        dense = runner.dense_greedy(prefix, n)
        assert prefix.cache.get_seq_length() == 48  # the prefix is left as it was
        for guess in (dense, [1] * n):
            got, _, exact = runner.policy_greedy(prefix, guess, cfg, stop=set(), rounds=n)
            assert exact and got == want.tolist()


def test_dense_greedy_on_a_hybrid_model_past_its_window():
    """A full sliding window cannot be cropped: the dense reference decodes on a copy, equals
    transformers' own greedy decoding, and leaves the prefix untouched (RULER on Gemma-3)."""
    from conftest import WINDOW, tiny_variant

    model = tiny_variant("gemma3")
    ids = torch.randint(3, VOCAB, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(7))
    n = 2 * WINDOW
    want = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1] :].tolist()
    runner = EvalRunner(model, None, EvalSettings(), progress=False)
    with runner.ev:
        prefix = runner.ev.prefill(ids)
        assert runner.dense_greedy(prefix, n) == want
        assert prefix.cache.get_seq_length() == ids.shape[1]
        assert runner.dense_greedy(prefix, n) == want  # the same again from the untouched prefix


# ---------------------------------------------------------------------- RULER, offline
def test_sentence_splitter_and_zeta():
    assert split_sentences("One. Two?  Three!\nFour") == ["One.", "Two?", "Three!", "Four"]
    assert riemann_zeta(2.0) == pytest.approx(math.pi**2 / 6, rel=1e-12)
    assert riemann_zeta(4.0) == pytest.approx(math.pi**4 / 90, rel=1e-12)
    with pytest.raises(ValueError):
        riemann_zeta(1.0)


def test_ruler_scores_are_rulers_string_match():
    pytest.importorskip("long_context_eval")
    assert ruler_score("qa_1", "It is in France.", ["Italy", "france"]) == 100.0  # any reference, any case
    assert ruler_score("qa_1", "Spain", ["Italy", "France"]) == 0.0
    assert ruler_score("niah_multivalue", "1234 and 5678", ["1234", "5678", "9999", "0000"]) == 50.0
    assert set(TASKS) >= {"niah_single_2", "niah_multikey_1", "niah_multivalue", "vt", "cwe", "fwe", "qa_1"}


# ---------------------------------------------------------------------- genres
def test_text_files_and_the_standard_library_genre(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("a text of my own\n", encoding="utf-8")
    assert load_text(f"file:{path}") == "a text of my own\n"
    with pytest.raises(DatasetMissingError):
        load_text(f"file:{tmp_path / 'missing.txt'}")
    code = code_text()
    assert "# os.py\n" in code and "def " in code and len(code) > 1_000_000
    with pytest.raises(ValueError, match="file:PATH"):
        load_text("no-such-genre")


def test_summary_reports_each_layers_budget_and_what_it_fetched():
    """allocation='calibrated': the per-layer budgets come from the artifact's recall curves,
    keep the mean, and summary() shows each next to what the layer fetched."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    cfg = InfiniGenConfig(alpha=math.inf, budget=0.25, allocation="calibrated", calibration_tokens=64)
    with attach(model, cfg, progress=False) as session, session.new_cache() as cache:
        model.generate(input_ids=ids, **cache_kwargs(model, cache), max_new_tokens=6, do_sample=False)
        layers = [p for p in cache.summary()["per_layer"] if p["speculated"]]
    budgets = [p["budget"] for p in layers]
    assert len(budgets) == model.config.num_hidden_layers - cfg.dense_layers
    assert sum(budgets) / len(budgets) == pytest.approx(0.25, rel=1e-6)
    for p in layers:
        rounded = 2 if p.get("correction") else 1  # a ceil per transfer: the speculated part, the top-up
        assert p["fetched_fraction"] <= p["budget"] + rounded / 40 + 1e-9
        assert p["fetched_fraction"] >= p["budget"] - 1e-9


def test_variant_strings_parse_or_are_refused_in_one_sentence():
    from infinigen.cli import eval_variants
    from infinigen.errors import InfiniGenError

    got = eval_variants(["quest 512:policy=quest budget=1 budget_tokens=512", "c:allocation=calibrated"])
    assert got == (
        ("quest 512", {"policy": "quest", "budget": 1.0, "budget_tokens": 512}),
        ("c", {"allocation": "calibrated"}),
    )
    assert eval_variants([]) is None
    for bad in ["no-colon", "x:alpha", "x:nonsense=1", "x:allocation=bogus", ":budget=0.1"]:
        with pytest.raises(InfiniGenError) as err:
            eval_variants([bad])
        assert "\n" not in str(err.value)
