"""Per-layer partial channel counts (`channel_allocation`): the partial recall measured at
calibration, the allocation over the layers, the artifact's tables, and the selector."""

import math

import pytest
import torch

from conftest import tiny_model
from infinigen import ConfigError, InfiniGenConfig, SkewArtifact, SkewArtifactError, attach
from infinigen.compat import cache_kwargs
from infinigen.models import get_adapter
from infinigen.select import make_selector
from infinigen.skew import calibrate, synthetic_calibration_ids
from infinigen.skew.tables import allocate_channels, channel_grid, oracle_recall_curve, partial_recall_table
from infinigen.speculate import partial_projection


# ---------------------------------------------------------------------- allocation
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.34, 0.5, 0.77, 1.0])
def test_allocation_keeps_the_mean_the_floor_and_the_cap(seed, ratio):
    g = torch.Generator().manual_seed(seed)
    d = [16, 64, 128][seed % 3]
    layers = range(2, 2 + 3 + seed * 4)
    grid = channel_grid(d)
    tables = {i: torch.rand(len(grid), generator=g).sort().values for i in layers}
    got = allocate_channels(tables, grid, ratio, d)
    assert sorted(got) == list(layers)
    total = sum(got.values())
    assert total <= ratio * d * len(layers) + 1e-9  # never above r * d on average
    assert total > ratio * d * len(layers) - 1  # as close as integer counts allow
    floor = min(d // 8, math.floor(ratio * d * len(layers)) // len(layers))
    assert all(floor <= c <= d for c in got.values())


def test_allocation_gives_channels_where_the_recall_grows():
    d = 64
    grid = channel_grid(d)
    x = torch.tensor(grid, dtype=torch.float32)
    flat = torch.full((len(grid),), 0.9)  # the top d/8 channels already rank as all of them do
    rising = 0.2 + 0.6 * x / d  # every channel adds the same recall
    got = allocate_channels({2: flat, 3: rising, 4: flat}, grid, 0.3, d)
    assert got == {2: d // 8, 3: math.floor(3 * 0.3 * d) - 2 * (d // 8), 4: d // 8}
    # Past the cap, what is left goes to the flat layers.
    assert allocate_channels({2: flat, 3: rising, 4: flat}, grid, 0.5, d) == {2: 16, 3: d, 4: 16}
    # Equal curves split equally; a steeper curve takes more.
    assert allocate_channels({0: rising, 1: rising}, grid, 0.5, d) == {0: 32, 1: 32}
    steep = 0.2 + 0.7 * (1 - torch.exp(-x / 12))
    shallow = 0.2 + 0.1 * (1 - torch.exp(-x / 12))
    got = allocate_channels({0: shallow, 1: steep}, grid, 0.5, d)
    assert got[1] > 32 > got[0] and got[0] + got[1] == 64


# ---------------------------------------------------------------------- measured partial recall
def test_partial_recall_with_every_channel_is_the_oracles():
    g = torch.Generator().manual_seed(0)
    h, hkv, t, d = 4, 2, 48, 16
    q = torch.randn(h, t, d, generator=g) * 2
    k = torch.randn(hkv, t, d, generator=g) * 2
    skew = torch.linalg.qr(torch.randn(hkv, d, d, generator=g))[0]
    order = torch.stack([torch.randperm(d, generator=g) for _ in range(hkv)])
    positions = torch.tensor([12, 30, 47])
    fractions = (0.05, 0.1, 0.2)
    table = partial_recall_table(q, k, positions, d**-0.5, skew, order, [2, 8, d], fractions)
    oracle = oracle_recall_curve(q, k, positions, d**-0.5, torch.tensor(fractions, dtype=torch.float64)).mean()
    assert table[-1].item() == pytest.approx(oracle.item(), abs=1e-5)
    assert table[0] < table[-1]  # two of sixteen random channels rank worse than all of them


def _known_model():
    """Layer 2's queries and keys live on one channel per head (before RoPE, which makes it
    two): two skewed channels already rank as all of them do, so its measured recall is flat
    and it needs only the floor; layer 3 (random, full rank) needs the rest."""
    model = tiny_model("llama")
    d = get_adapter(model).head_dim
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        attn = model.model.layers[2].self_attn
        for proj, heads in ((attn.q_proj, 4), (attn.k_proj, 2)):
            w = torch.zeros_like(proj.weight)
            for head in range(heads):
                w[head * d] = torch.randn(proj.weight.shape[1], generator=g) * 1.5
            proj.weight.copy_(w)
    return model, d


def test_calibrated_channels_calibrate_save_reload_and_decode(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model, d = _known_model()
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    cfg = InfiniGenConfig(budget=0.25, partial_ratio=0.5, channel_allocation="calibrated", calibration_tokens=64)
    with attach(model, cfg, progress=False) as session, session.new_cache() as cache:
        art = session.artifact
        model.generate(input_ids=ids, **cache_kwargs(model, cache), max_new_tokens=4, do_sample=False)
        described = cache.summary()["policy_settings"]["layer_channels"]
    flat, rising = art.channel_recall[2], art.channel_recall[3]
    assert (flat - flat[-1]).abs().max() < 1e-4 and rising[-1] - rising[0] > 0.02
    assert described == {"2": d // 8, "3": d - d // 8}  # mean r * d = 8 over layers 2 and 3
    (path,) = (tmp_path / "skew").glob("*.safetensors")

    import infinigen.skew as skew_mod

    monkeypatch.setattr(skew_mod, "calibrate", lambda *a, **k: pytest.fail("recalibrated a sound artifact"))
    with attach(model, cfg, progress=False) as session, session.new_cache() as cache:
        out = model.generate(input_ids=ids, **cache_kwargs(model, cache), max_new_tokens=4, do_sample=False)
        assert cache.summary()["policy_settings"]["layer_channels"] == described
        proj = cache.selector.proj
        assert [proj[i].shape[-1] for i in (2, 3)] == [d // 8, d - d // 8]
        loaded = SkewArtifact.load(path)
        for i in (2, 3):  # the top-c prefix of the ranked channels, on the skew's columns
            chosen = loaded.channel_orders[i][:, : proj[i].shape[-1]].sort(-1).values
            torch.testing.assert_close(proj[i], partial_projection(loaded.skews[i], chosen, d), rtol=0, atol=0)
    assert out.shape[-1] == ids.shape[-1] + 4


def test_uniform_is_the_artifacts_channels_with_or_without_the_tables(tmp_path):
    """uniform: every layer's projection is the artifact's round(r * d) channels, exactly as
    before the tables existed, and an artifact without them decodes the same."""
    model, d = _known_model()
    adapter = get_adapter(model)
    cfg = InfiniGenConfig(budget=0.25, calibration_tokens=64, allocation="uniform", correction_target=1.5)
    art = calibrate(model, adapter, synthetic_calibration_ids(96, 64), cfg.partial_ratio, True, progress=False)
    assert cfg.channel_allocation == "uniform"
    selector = make_selector(cfg, adapter, art)
    for i in range(adapter.num_layers):
        assert torch.equal(selector.proj[i], partial_projection(art.skews[i], art.channels[i], d))
        assert selector.proj[i].shape[-1] == round(cfg.partial_ratio * d)
    old = SkewArtifact(**{**vars(art), "channel_orders": {}, "channel_recall": {}, "channel_grid": None})
    old.save(tmp_path / "old.safetensors")
    art.save(tmp_path / "new.safetensors")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    outs = []
    for name in ("old", "new"):
        with attach(model, cfg, skew=tmp_path / f"{name}.safetensors", progress=False) as session:
            with session.new_cache() as cache:
                out = model.generate(
                    input_ids=ids, **cache_kwargs(model, cache), max_new_tokens=5, do_sample=False,
                    output_logits=True, return_dict_in_generate=True,
                )  # fmt: skip
                outs.append(torch.stack(out.logits))
                c = round(cfg.partial_ratio * d)
                assert cache.summary()["policy_settings"]["layer_channels"] == {"2": c, "3": c}
    assert torch.equal(outs[0], outs[1])


def test_an_artifact_without_channel_tables_is_refused_or_recalibrated(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("qwen2")
    uniform = InfiniGenConfig(calibration_tokens=64)
    calibrated = uniform.replace(channel_allocation="calibrated")
    with attach(model, uniform, progress=False) as session:
        art = session.artifact
    (path,) = (tmp_path / "skew").glob("*.safetensors")
    SkewArtifact(**{**vars(art), "channel_orders": {}, "channel_recall": {}, "channel_grid": None}).save(path)
    given = tmp_path / "given.safetensors"
    given.write_bytes(path.read_bytes())

    with attach(model, uniform, skew=given, progress=False):  # uniform needs no tables
        pass
    with pytest.raises(SkewArtifactError, match="no channel recall tables.*recompute it with `infinigen skew"):
        attach(model, calibrated, skew=given, progress=False)
    assert model.config._attn_implementation != "infinigen"
    # A session on the old cached file: a calibrated cache recalibrates and replaces it.
    with attach(model, uniform, progress=False) as session:
        assert not session.artifact.has_channel_recall()
        with pytest.warns(UserWarning, match="no channel recall tables.*recalibrating"):
            with session.new_cache(calibrated) as cache:
                assert "layer_channels" in cache.selector.describe()
    assert SkewArtifact.load(path).has_channel_recall()
    with pytest.raises(ConfigError, match="channel_allocation"):
        InfiniGenConfig(channel_allocation="bogus")
