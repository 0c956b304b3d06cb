"""Speculation through a query map fitted to the previous layer's input (`speculate_from`
"fitted"): the fit itself, the artifact that carries the maps, and the selector that uses them."""

import pytest
import torch

from conftest import VOCAB, tiny_model
from infinigen import InfiniGenConfig, SkewArtifact, SkewArtifactError, attach
from infinigen.compat import cache_kwargs
from infinigen.models import get_adapter
from infinigen.select import make_selector
from infinigen.skew import calibrate, collect_qk, synthetic_calibration_ids
from infinigen.skew.query_map import apply_query_map, fit_query_map, fold_skew_into_map, own_projection

R = InfiniGenConfig().partial_ratio  # the artifacts below serve the default configuration


def _affine(seed: int, t: int = 300, d_in: int = 10, d_out: int = 12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d_in, generator=g) * 3 + 1
    m = torch.randn(d_in + 1, d_out, generator=g)
    own = torch.randn(d_in + 1, d_out, generator=g)
    return x, m, own, x @ m[:-1] + m[-1]


@pytest.mark.parametrize("seed", range(3))
def test_the_fit_recovers_an_affine_map_and_shrinks_to_the_own_projection(seed):
    x, m, own, y = _affine(seed)
    torch.testing.assert_close(fit_query_map(x, y, own, ridge=0.0), m, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fit_query_map(x, y, own, ridge=1e7), own, rtol=1e-3, atol=1e-3)
    # in between: never further from the data than the own projection is
    mid = fit_query_map(x, y, own, ridge=0.1)
    err = lambda w: (apply_query_map(x[None], w)[0] - y).pow(2).sum()  # noqa: E731
    assert err(mid) < err(own)
    with pytest.raises(ValueError, match="ridge"):
        fit_query_map(x, y, own, ridge=-1.0)


def test_own_projection_is_the_linear_layer():
    lin = torch.nn.Linear(7, 5, bias=True)
    x = torch.randn(2, 3, 7)
    torch.testing.assert_close(apply_query_map(x, own_projection(lin).float()), lin(x), rtol=1e-5, atol=1e-5)
    lin.bias = None
    torch.testing.assert_close(apply_query_map(x, own_projection(lin).float()), lin(x), rtol=1e-5, atol=1e-5)


def test_folding_the_skew_into_a_map_is_the_per_head_product():
    g = torch.Generator().manual_seed(0)
    heads, kv, d = 4, 2, 8
    m = torch.randn(11, heads * d, generator=g)
    skew = torch.linalg.qr(torch.randn(kv, d, d, generator=g)).Q
    x = torch.randn(1, 3, 10, generator=g)
    folded = apply_query_map(x, fold_skew_into_map(m, skew, heads)).view(1, 3, heads, d)
    plain = apply_query_map(x, m).view(1, 3, heads, d)
    want = torch.einsum("bthd,hde->bthe", plain, skew.repeat_interleave(heads // kv, 0))
    torch.testing.assert_close(folded, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_calibration_fits_every_layer_but_the_first_to_its_previous_input(family):
    """Each map equals the ridge fit of the layer's query projection (of its own input) on the
    previous layer's normalized input, both captured from the model's own forward pass."""
    model = tiny_model(family)
    adapter = get_adapter(model)
    ids = synthetic_calibration_ids(VOCAB, 64)
    art = calibrate(model, adapter, ids, R, True, progress=False)
    assert sorted(art.query_maps) == list(range(1, adapter.num_layers)) and art.has_query_maps()
    inputs = {}
    handles = [
        m.register_forward_pre_hook(
            lambda mod, a, k, i=i: inputs.__setitem__(i, k.get("hidden_states", a[0] if a else None)[0]),
            with_kwargs=True,
        )
        for i, m in enumerate(adapter.attention_modules())
    ]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    for i in range(1, adapter.num_layers):
        q_proj = adapter.attention_modules()[i].q_proj
        want = fit_query_map(inputs[i - 1], q_proj(inputs[i]).detach(), own_projection(q_proj))
        torch.testing.assert_close(art.query_maps[i].float(), want, rtol=2e-3, atol=2e-3)  # stored in fp16
        d_in = inputs[i].shape[-1]
        assert art.query_maps[i].shape == (d_in + 1, adapter.num_heads * adapter.head_dim)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_a_map_equal_to_the_own_projection_decodes_as_plain_speculation(family, tmp_path):
    """fitted with M = [W_qᵀ; b] must be exactly InfiniGen from the previous layer (the skew
    folded into the map for a model without RoPE): the map is the only thing it changes."""
    model = tiny_model(family)
    adapter = get_adapter(model)
    art = calibrate(model, adapter, synthetic_calibration_ids(VOCAB, 64), R, True, progress=False)
    mods = adapter.attention_modules()
    own = {i: own_projection(mods[i].q_proj).to(torch.float32) for i in range(1, adapter.num_layers)}
    SkewArtifact(**{**vars(art), "query_maps": own}).save(tmp_path / "own.safetensors")
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    outs, chosen = [], []
    for speculate_from in ("previous", "fitted"):
        cfg = InfiniGenConfig(budget=0.25, speculate_from=speculate_from, calibration_tokens=64)
        with attach(model, cfg, skew=tmp_path / "own.safetensors", progress=False) as session:
            with session.new_cache(trace=True) as cache:
                out = model.generate(
                    input_ids=ids, **cache_kwargs(model, cache), max_new_tokens=5, do_sample=False,
                    output_logits=True, return_dict_in_generate=True,
                )  # fmt: skip
                outs.append(torch.stack(out.logits))
                chosen.append([(r.layer, r.selection.indices.tolist()) for r in cache.trace if r.selection])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    assert chosen[0] == chosen[1] and chosen[0]


def test_fitted_speculation_uses_the_maps_and_changes_the_selection():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    art = calibrate(model, adapter, synthetic_calibration_ids(VOCAB, 64), R, True, progress=False)
    fitted = make_selector(
        InfiniGenConfig(budget=0.25, allocation="uniform", correction_target=1.5, speculate_from="fitted"), adapter, art
    )
    plain = make_selector(
        InfiniGenConfig(budget=0.25, allocation="uniform", correction_target=1.5, speculate_from="previous"),
        adapter,
        art,
    )
    assert InfiniGenConfig().speculate_from == "fitted"  # the default
    assert fitted.query_from == plain.query_from == "previous"
    assert sorted(fitted.query_maps) == [2, 3] and not plain.query_maps
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(4))
    pe = model.model.rotary_emb(x, torch.tensor([[30]]))
    assert not torch.allclose(fitted.query(2, x, pe), plain.query(2, x, pe))
    torch.testing.assert_close(plain.query(2, x, pe), adapter.queries(2, x, pe))


def test_an_artifact_without_query_maps_is_refused_or_recalibrated(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("qwen2")
    plain = InfiniGenConfig(calibration_tokens=64, speculate_from="previous")
    fitted = plain.replace(speculate_from="fitted")
    with attach(model, plain, progress=False) as session:
        art = session.artifact
    (path,) = (tmp_path / "skew").glob("*.safetensors")
    SkewArtifact(**{**vars(art), "query_maps": {}}).save(path)
    given = tmp_path / "given.safetensors"
    given.write_bytes(path.read_bytes())
    with attach(model, plain, skew=given, progress=False):  # plain speculation needs no maps
        pass
    with pytest.raises(SkewArtifactError, match="no query maps.*recompute it with `infinigen skew"):
        attach(model, fitted, skew=given, progress=False)
    with attach(model, plain, progress=False) as session:
        assert not session.artifact.has_query_maps()
        with pytest.warns(UserWarning, match="no query maps.*recalibrating"):
            with session.new_cache(fitted) as cache:
                assert cache.selector.query_maps
    reloaded = SkewArtifact.load(path)
    assert reloaded.has_query_maps()
    for i, m in art.query_maps.items():
        assert torch.equal(reloaded.query_maps[i], m) and m.dtype == torch.float16


def test_collect_qk_without_maps_is_unchanged():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    ids = synthetic_calibration_ids(VOCAB, 32)
    maps = {}
    q1, k1 = collect_qk(model, adapter, ids, progress=False)
    q2, k2 = collect_qk(model, adapter, ids, progress=False, query_maps=maps)
    assert all(torch.equal(q1[i], q2[i]) and torch.equal(k1[i], k2[i]) for i in q1) and sorted(maps) == [1, 2, 3]
