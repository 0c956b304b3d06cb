"""Any model the user has, offline: the default GGUF, a .gguf path, a Hugging Face folder of a
supported family. What cannot be used (a missing tokenizer or weights, another family, a Hub
id, a cache folder that cannot be written) is one sentence and exit status 2, before any
weight is read or any conversion runs; --quiet shows no library's progress bar."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from conftest import _byte_tokenizer, one_error_line, require_default_model, run_cli
from infinigen.cli import main


def _generate(capsys, model, *more: str) -> tuple[int, str, str]:
    return run_cli(
        capsys, "generate", "--model", str(model), "--quiet", "--prompt", "hi", "--max-new-tokens", "2", *more
    )


# ---------------------------------------------------------------- model folders that cannot be used
@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if transformers is asked to read a model: the refusal comes before."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def _copy_without(tiny_model_dir, tmp_path, *names: str):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    for name in names:
        (folder / name).unlink()
    return folder


def test_a_folder_without_a_tokenizer_says_so(tiny_model_dir, tmp_path, capsys, no_load):
    folder = _copy_without(tiny_model_dir, tmp_path, "tokenizer.json", "tokenizer_config.json")
    rc, out, err = _generate(capsys, folder)
    assert rc == 2 and f"model folder {folder} has no tokenizer (tokenizer.json" in one_error_line(err)
    assert out == ""


def test_a_folder_without_weights_says_so(tiny_model_dir, tmp_path, capsys, no_load):
    folder = _copy_without(tiny_model_dir, tmp_path, "model.safetensors")
    rc, _, err = _generate(capsys, folder)
    assert rc == 2 and f"model folder {folder} has no weights (*.safetensors or pytorch_model*.bin)" in err


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_folder_of_another_family_names_the_supported_ones(family, tmp_path, capsys, no_load):
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    tok = _byte_tokenizer()
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2))
    else:
        model = BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    capsys.readouterr()
    rc, _, err = _generate(capsys, tmp_path)
    line = one_error_line(err)  # no transformers warnings around it: nothing was loaded
    assert rc == 2 and f"model type {family!r} in {tmp_path} is not supported" in line
    assert line.endswith("supported: gemma3_text, llama, mistral, opt, qwen2, qwen3")


@pytest.mark.parametrize(
    "spec, says",
    [
        ("HuggingFaceTB/SmolLM2-135M", "infinigen does not download: if it is a Hugging Face Hub id, download it"),
        ("{tmp}/nowhere", "not found: give 'smollm2', 'gemma3-270m', a model folder or a .gguf file"),
        ("{tmp}/nowhere.gguf", "GGUF file not found"),
        ("{tmp}/a-file", "is a file: give its folder"),
        ("{tmp}", "has no config.json"),
    ],
)
def test_a_model_that_is_not_there_is_input(spec, says, tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    rc, _, err = _generate(capsys, spec.replace("{tmp}", str(tmp_path)))
    assert rc == 2 and says in one_error_line(err)


# ---------------------------------------------------------------- the cache folder
def _unwritable_caches(tmp_path, mount_tmpfs):
    (tmp_path / "a-file").write_text("x")
    yield tmp_path / "a-file" / "cache", "Not a directory"
    yield tmp_path / "a-file", "it is not a folder"
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        yield locked, "Permission denied"
    else:  # root writes through permissions; a read-only mount stops it
        try:
            yield mount_tmpfs("1m", readonly=True), "Read-only file system"
        except pytest.skip.Exception:
            pass


def test_an_unwritable_cache_folder_is_refused_before_converting(tmp_path, capsys, monkeypatch, mount_tmpfs):
    """$INFINIGEN_CACHE_DIR read-only, under a file or a file: one sentence that names the
    variable, before the GGUF is even opened (the fake one here would fail if it were)."""
    import infinigen.loading

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read")
    monkeypatch.setattr(infinigen.loading, "_remove_abandoned", lambda out: pytest.fail("the conversion started"))
    for cache, why in _unwritable_caches(tmp_path, mount_tmpfs):
        monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(cache))
        rc, out, err = _generate(capsys, gguf)
        line = one_error_line(err)
        assert rc == 2 and out == ""
        assert line == (
            f"error: the cache folder {cache} ($INFINIGEN_CACHE_DIR) is not writable ({why}): "
            "point INFINIGEN_CACHE_DIR at a writable folder"
        )


def test_skew_into_an_unwritable_cache_is_refused_before_calibrating(tiny_model_dir, tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    rc, _, err = run_cli(capsys, "skew", "--model", str(tiny_model_dir), "--quiet", "--calibration-tokens", "64")
    assert rc == 2 and "($INFINIGEN_CACHE_DIR) is not writable" in one_error_line(err)


# ---------------------------------------------------------------- progress bars
def test_quiet_silences_every_library_bar(capfd):
    """HF's bars (its own switch) and plain tqdm ones (the GGUF converter's) alike; restored after."""
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    from infinigen.loading import quiet_progress_bars

    with quiet_progress_bars():
        for _ in tqdm(range(3), desc="plain tqdm"):
            pass
        for _ in hf_logging.tqdm(range(3), desc="transformers"):
            pass
    assert capfd.readouterr().err == ""
    assert hf_logging.is_progress_bar_enabled()
    for _ in tqdm(range(3), desc="plain tqdm"):
        pass
    assert "plain tqdm" in capfd.readouterr().err


def test_a_long_prefill_shows_a_bar_only_when_asked(capfd):
    from conftest import tiny_model
    from infinigen.prefill import chunked_prefill

    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 40))

    def prefill(tokens, chunk, progress):
        from transformers import DynamicCache

        chunked_prefill(model, ids[:, :tokens], DynamicCache(), chunk=chunk, progress=progress)
        return capfd.readouterr().err

    err = prefill(40, 16, True)
    assert "prefill" in err and "/40" in err
    assert prefill(40, 16, False) == ""
    assert prefill(16, 16, True) == ""  # one chunk: no bar


# ---------------------------------------------------------------- real models (SmolLM2-135M)
@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("smol-cache")


@pytest.mark.real
def test_a_gguf_path_converts_once_without_a_bar_and_generates(smol_cache, capfd, monkeypatch):
    """`--model FILE.gguf` (the default SmolLM2's GGUF) with --quiet: the conversion and the load
    draw nothing (transformers' bars and the GGUF converter's plain tqdm one), stdout is the run."""
    require_default_model()
    from infinigen.loading import smollm2_gguf

    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(smol_cache))
    gguf = smollm2_gguf()
    rc = main(
        ["generate", "--model", str(gguf), "--quiet", "--prompt", "hi", "--max-new-tokens", "2", "--policy", "dense"]
    )
    out, err = capfd.readouterr()
    assert rc == 0 and err == "" and "2 new tokens" in out
    assert list((smol_cache / "models").iterdir())  # converted once, kept


@pytest.mark.real
def test_a_hugging_face_folder_loads_without_conversion(smol_cache, tmp_path, capsys, monkeypatch):
    """SmolLM2 saved with save_pretrained (config, safetensors, tokenizer) is a model folder that
    `--model DIR` runs as it is, attached."""
    require_default_model()
    import infinigen.loading
    from infinigen.loading import load_model, smollm2_gguf

    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(smol_cache))
    model, tok = load_model(str(smollm2_gguf()), progress=False)
    folder = tmp_path / "smollm2"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    monkeypatch.setattr(infinigen.loading, "convert_gguf", lambda *a, **k: pytest.fail("converted"))
    rc, out, err = _generate(capsys, folder, "--policy", "full")  # attached, without minutes of calibration
    assert rc == 0 and "policy=full: 2 new tokens" in out, err


def test_python_dash_m_infinigen_is_the_command():
    import subprocess

    from infinigen.cli import version

    done = subprocess.run([sys.executable, "-m", "infinigen", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"infinigen {version()}"


def test_a_gguf_conversion_is_keyed_by_content_not_by_where_the_file_lies(tmp_path):
    """A new environment (another venv, a fresh clone) holding the same model reuses its
    conversion instead of writing another copy of the weights; changed bytes do not."""
    from infinigen.loading import _gguf_cache_folder

    first, second, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in (
        (first, b"GGUF" + bytes(5000)),
        (second, b"GGUF" + bytes(5000)),
        (other, b"GGUF" + bytes(4999) + b"x"),
    ):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(second, ns=(1, 1))  # another install: another path and time
    cache = tmp_path / "cache"
    assert _gguf_cache_folder(first, cache) == _gguf_cache_folder(second, cache)
    assert _gguf_cache_folder(other, cache) != _gguf_cache_folder(first, cache)
    assert _gguf_cache_folder(first, cache).parent == cache / "models"
