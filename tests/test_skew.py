"""Skew matrices, folding, artifacts and their verification."""

import pytest
import torch

from conftest import left_padded_batch, tiny_model
from infinigen import InfiniGenConfig, SkewArtifact, SkewArtifactError, attach
from infinigen.models import get_adapter
from infinigen.skew import calibrate, model_fingerprint, synthetic_calibration_ids


def _artifact(model, ratio=0.3, skewed=True):
    adapter = get_adapter(model)
    ids = synthetic_calibration_ids(model.config.vocab_size, 64)
    return calibrate(model, adapter, ids, ratio, skewed, progress=False)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_skew_matrices_are_orthogonal_and_channels_sized(family):
    model = tiny_model(family)
    art = _artifact(model, ratio=0.25)
    d = get_adapter(model).head_dim
    for i, a in art.skews.items():
        eye = torch.eye(d).expand_as(a)
        torch.testing.assert_close(a @ a.transpose(-1, -2), eye, rtol=0, atol=1e-5)
        assert art.channels[i].shape[-1] == round(0.25 * d)
        assert (art.channels[i].diff(dim=-1) > 0).all()  # sorted, unique


def test_skew_concentrates_query_mass_on_tiny_model():
    from infinigen.skew import collect_qk, query_mass_in_channels, skew_from_qk

    model = tiny_model("llama")
    adapter = get_adapter(model)
    qs, ks = collect_qk(model, adapter, synthetic_calibration_ids(96, 64), progress=False)
    for i in range(adapter.num_layers):
        a, c = skew_from_qk(qs[i], ks[i], adapter.num_kv_heads, 0.25, skewed=True)
        _, c0 = skew_from_qk(qs[i], ks[i], adapter.num_kv_heads, 0.25, skewed=False)
        # The SVD basis is optimal for Σq² in its top columns on its own calibration data.
        assert query_mass_in_channels(qs[i], a, c) >= query_mass_in_channels(qs[i], None, c0) - 1e-6


def test_folding_leaves_opt_logits_unchanged():
    model = tiny_model("opt")
    ids, mask = left_padded_batch()
    before = model(input_ids=ids, attention_mask=mask).logits
    art = _artifact(model)
    adapter = get_adapter(model)
    q_before = adapter.queries(2, torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0)), None)
    originals = adapter.fold_skew(art.skews)
    after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    # The folded projection produces the skewed query q·A.
    q_after = adapter.queries(2, torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0)), None)
    torch.testing.assert_close(q_after, torch.einsum("bhtd,hde->bhte", q_before, art.skews[2]), rtol=1e-4, atol=1e-4)
    # Every parameter the fold changed comes back with its original value.
    assert {id(p) for p, _ in originals} == {
        id(p) for name, p in model.named_parameters() if ".self_attn.q_proj" in name or ".self_attn.k_proj" in name
    }


def test_artifact_round_trip_and_mismatch_is_refused(tmp_path):
    model = tiny_model("llama")
    art = _artifact(model)
    path = tmp_path / "skew.safetensors"
    art.save(path)
    loaded = SkewArtifact.load(path)
    assert loaded.fingerprint == art.fingerprint and loaded.partial_ratio == pytest.approx(0.3)
    for i in art.channels:
        assert torch.equal(loaded.channels[i], art.channels[i])
        torch.testing.assert_close(loaded.skews[i], art.skews[i])

    # Same model: accepted through attach.
    with attach(model, InfiniGenConfig(), skew=path, progress=False) as session:
        assert session.artifact.fingerprint == art.fingerprint
    # Other settings: refused.
    with pytest.raises(SkewArtifactError, match="partial_ratio"):
        attach(model, InfiniGenConfig(partial_ratio=0.5), skew=path, progress=False)
    # A changed model (one weight nudged): refused, and the model is left untouched.
    other = tiny_model("llama")
    with torch.no_grad():
        other.model.layers[1].self_attn.q_proj.weight[0, 0] += 1e-3
    with pytest.raises(SkewArtifactError, match="another model"):
        attach(other, InfiniGenConfig(), skew=str(path), progress=False)
    assert other.config._attn_implementation != "infinigen"
    with attach(other, InfiniGenConfig(policy="full"), progress=False):  # nothing was left attached
        pass


def test_corrupt_or_missing_artifact_is_a_clear_error(tmp_path):
    model = tiny_model("llama")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(SkewArtifactError, match="cannot read"):
        attach(model, InfiniGenConfig(), skew=bad, progress=False)
    with pytest.raises(FileNotFoundError):
        attach(model, InfiniGenConfig(), skew=tmp_path / "missing.safetensors", progress=False)


def test_artifact_is_computed_once_then_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("qwen2")
    cfg = InfiniGenConfig(calibration_tokens=64)
    with attach(model, cfg, progress=False):
        pass
    files = list((tmp_path / "skew").glob("*.safetensors"))
    assert len(files) == 1

    import infinigen.skew as skew_mod

    def boom(*a, **k):
        raise AssertionError("recalibrated although a matching artifact was cached")

    monkeypatch.setattr(skew_mod, "calibrate", boom)
    with attach(model, cfg, progress=False):
        pass
    # A different model gets its own artifact, never the cached one.
    monkeypatch.undo()
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    with attach(tiny_model("qwen2", seed=5), cfg, progress=False):
        pass
    assert len(list((tmp_path / "skew").glob("*.safetensors"))) == 2


def test_fingerprint_tracks_weights_and_config():
    a, b = tiny_model("llama"), tiny_model("llama")
    assert model_fingerprint(a) == model_fingerprint(b)
    with torch.no_grad():
        b.lm_head.weight[3, 3] += 1.0
    assert model_fingerprint(a) != model_fingerprint(b)
