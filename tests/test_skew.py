"""Skew matrices, folding, artifacts and their verification."""

import warnings

import pytest
import torch

from conftest import left_padded_batch, tiny_model
from infinigen import InfiniGenConfig, SkewArtifact, SkewArtifactError, attach
from infinigen.models import get_adapter
from infinigen.skew import calibrate, model_fingerprint, synthetic_calibration_ids
from infinigen.skew.calibrate import SYNTHETIC_SOURCE, default_calibration_source


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
    with attach(model, InfiniGenConfig(partial_ratio=0.3), skew=path, progress=False) as session:
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
    with pytest.raises(SkewArtifactError, match="cannot be read.*not used: recompute it with `infinigen skew"):
        attach(model, InfiniGenConfig(), skew=bad, progress=False)
    with pytest.raises(SkewArtifactError, match="not found, compute it with `infinigen skew"):
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


# ---------------------------------------------------------------------- damaged, stale, interrupted
def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flipped":  # 4 KiB of flipped bytes in the middle: inside the tensors, header intact
        mid = len(data) // 2
        data[mid : mid + 4096] = bytes(b ^ 0xFF for b in data[mid : mid + 4096])
    elif how == "truncated":
        data = data[: len(data) // 2]
    elif how == "old format":  # what the previous version wrote: no checksum, format 1
        from safetensors import safe_open
        from safetensors.torch import load_file, save

        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata())
        meta.pop("checksum")
        meta["format_version"] = "1"
        data = save(load_file(str(path)), metadata=meta)
    path.write_bytes(bytes(data))


def _cached(tmp_path):
    return list((tmp_path / "skew").glob("*.safetensors"))


def _tiny_artifact_model():
    """A model whose artifact is big enough for 4 KiB in its middle to land inside a tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("how", ["flipped", "truncated", "old format"])
def test_a_damaged_or_stale_artifact_is_never_used(monkeypatch, tmp_path, how):
    """A given file is refused with the command that recomputes it; a cached one is recalibrated
    (with a warning) and replaced; neither is ever used."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = _tiny_artifact_model()
    cfg = InfiniGenConfig(calibration_tokens=64, partial_ratio=0.25)
    with attach(model, cfg, progress=False) as session:
        good = session.artifact
    (path,) = _cached(tmp_path)
    assert path.stat().st_size > 3 * 4096
    _damage(path, how)
    reason = {"flipped": "is damaged", "truncated": "cannot be read", "old format": "has format '1'"}[how]

    with pytest.raises(SkewArtifactError, match=reason) as info:
        SkewArtifact.load(path)
    given = tmp_path / "given.safetensors"
    given.write_bytes(path.read_bytes())
    with pytest.raises(SkewArtifactError) as info:
        attach(model, cfg, skew=given, progress=False)
    msg = str(info.value)
    assert reason in msg and "\n" not in msg
    assert f"`infinigen skew --partial-ratio 0.25 --calibration-tokens 64 --output {given}`" in msg
    assert model.config._attn_implementation != "infinigen"

    with pytest.warns(UserWarning, match=f"cached skew artifact .*{reason}.*recalibrating"):
        with attach(model, cfg, progress=False) as session:
            again = session.artifact
    for i in good.channels:  # the recalibrated artifact, the same as the first one
        assert torch.equal(again.channels[i], good.channels[i])
    assert _cached(tmp_path) == [path]
    assert SkewArtifact.load(path).fingerprint == good.fingerprint  # replaced by a sound one
    assert sorted(p.name for p in (tmp_path / "skew").iterdir()) == [path.name]


@pytest.mark.parametrize("made_on", ["prose:0123456789abcdef", None, "file:0123456789abcdef", "default"])
def test_a_cached_artifact_of_another_default_text_is_recalibrated(monkeypatch, tmp_path, made_on):
    """An artifact records what it was calibrated on. One made on another default text (an
    older version's, or without the record) is recalibrated with a warning; one made on the
    user's own text (`infinigen skew --calibration-file`) or on today's default text is used,
    with or without a tokenizer at hand."""
    if made_on == "default":
        made_on = default_calibration_source()
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    cfg = InfiniGenConfig(calibration_tokens=64)
    with attach(model, cfg, progress=False) as session:
        assert session.artifact.meta["calibration"] == SYNTHETIC_SOURCE  # no tokenizer: seeded ids
    (path,) = _cached(tmp_path)
    art = SkewArtifact.load(path)
    if made_on is None:
        del art.meta["calibration"]
    else:
        art.meta["calibration"] = made_on
    art.save(path)
    if made_on is not None and (made_on.startswith("file:") or made_on == default_calibration_source()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with attach(model, cfg, progress=False) as session:
                assert session.artifact.meta["calibration"] == made_on
        return
    with pytest.warns(UserWarning, match="was calibrated on .*not on prose.*recalibrating"):
        with attach(model, cfg, progress=False) as session:
            assert session.artifact.meta["calibration"] == SYNTHETIC_SOURCE
    assert SkewArtifact.load(path).meta["calibration"] == SYNTHETIC_SOURCE


def test_an_artifact_of_random_ids_is_replaced_once_a_tokenizer_allows_real_text(tmp_path):
    from infinigen.skew import check_calibration_source

    art = _artifact(tiny_model("llama"))
    art.meta["calibration"] = SYNTHETIC_SOURCE
    check_calibration_source(art, tmp_path / "a.safetensors", tokenizer_given=False)
    with pytest.raises(SkewArtifactError, match="synthetic ids, and real text"):
        check_calibration_source(art, tmp_path / "a.safetensors", tokenizer_given=True)


def test_interrupted_calibration_or_save_leaves_nothing_and_the_next_run_calibrates(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    cfg = InfiniGenConfig(calibration_tokens=64)

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    # Ctrl-C halfway through the calibration's forward pass.
    handle = model.model.layers[2].register_forward_pre_hook(ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        attach(model, cfg, progress=False)
    handle.remove()
    assert not (tmp_path / "skew").exists() or list((tmp_path / "skew").iterdir()) == []
    assert model.config._attn_implementation != "infinigen"

    # Ctrl-C while the artifact is being written: no partial file, no temporary left.
    import os as os_mod

    real_replace = os_mod.replace
    monkeypatch.setattr(os_mod, "replace", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        attach(model, cfg, progress=False)
    monkeypatch.setattr(os_mod, "replace", real_replace)
    assert list((tmp_path / "skew").iterdir()) == []

    with attach(model, cfg, progress=False) as session:
        art = session.artifact
    (path,) = _cached(tmp_path)
    assert SkewArtifact.load(path).fingerprint == art.fingerprint


def test_concurrent_saves_never_show_a_partial_artifact(tmp_path):
    """Two writers replacing one artifact while a reader loads it: every load sees a whole one."""
    import threading

    model = tiny_model("llama")
    art = _artifact(model)
    path = tmp_path / "skew.safetensors"
    art.save(path)
    stop = threading.Event()
    errors = []

    def write():
        try:
            while not stop.is_set():
                art.save(path)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for w in writers:
        w.start()
    try:
        for _ in range(50):
            assert SkewArtifact.load(path).fingerprint == art.fingerprint
    finally:
        stop.set()
        for w in writers:
            w.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == ["skew.safetensors"]
