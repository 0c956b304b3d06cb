"""Skew matrices and partial channels: calibration, artifacts, verification.

For each layer and KV head, stack the (post-RoPE) queries of the heads in its group over the
calibration tokens and take the right singular vectors A of that matrix (eigenvectors of
QᵀQ). A is orthogonal, so (qA)(kA)ᵀ = qkᵀ, but a few columns of qA now carry most of the
magnitude; the partial channels are the r·d columns of largest summed |qA| + |kA|.

For RoPE models the queries are rotated by position before the dot product, so the statistics
depend on position: calibration runs over a sequence as long as the contexts to be decoded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from infinigen.models import ModelAdapter

FORMAT_VERSION = "1"
MAX_DEFAULT_CALIBRATION = 8192


class SkewArtifactError(ValueError):
    """A skew artifact that does not belong to this model or these settings."""


@dataclass
class SkewArtifact:
    """Per-layer skew A [Hkv, d, d] (None: identity) and partial channels [Hkv, c]."""

    skews: dict[int, torch.Tensor | None]
    channels: dict[int, torch.Tensor]
    fingerprint: str
    partial_ratio: float
    skewed: bool
    calibration_tokens: int
    meta: dict[str, str] = field(default_factory=dict)

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"layer.{i}.channels": c.contiguous() for i, c in self.channels.items()}
        for i, a in self.skews.items():
            if a is not None:
                tensors[f"layer.{i}.skew"] = a.to(torch.float32).contiguous()
        meta = dict(self.meta)
        meta.update(
            format_version=FORMAT_VERSION,
            fingerprint=self.fingerprint,
            partial_ratio=repr(float(self.partial_ratio)),
            skewed=str(bool(self.skewed)),
            calibration_tokens=str(self.calibration_tokens),
        )
        tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)  # atomic: a crash never leaves a half-written artifact

    @classmethod
    def load(cls, path: str | os.PathLike) -> SkewArtifact:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"skew artifact not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
            tensors = load_file(str(path))
        except Exception as exc:  # corrupt or not a safetensors file
            raise SkewArtifactError(f"cannot read skew artifact {path}: {exc}") from exc
        if meta.get("format_version") != FORMAT_VERSION:
            raise SkewArtifactError(
                f"skew artifact {path} has format {meta.get('format_version')!r}, expected {FORMAT_VERSION!r}; "
                "delete it to recompute"
            )
        layers = sorted({int(k.split(".")[1]) for k in tensors if k.endswith(".channels")})
        skews = {i: tensors.get(f"layer.{i}.skew") for i in layers}
        channels = {i: tensors[f"layer.{i}.channels"] for i in layers}
        return cls(
            skews=skews,
            channels=channels,
            fingerprint=meta["fingerprint"],
            partial_ratio=float(meta["partial_ratio"]),
            skewed=meta["skewed"] == "True",
            calibration_tokens=int(meta["calibration_tokens"]),
            meta={k: v for k, v in meta.items() if k not in {"fingerprint", "partial_ratio", "skewed"}},
        )

    def verify(self, fingerprint: str, partial_ratio: float, skewed: bool, num_layers: int, source: str = "") -> None:
        """Refuse an artifact made for another model or other settings."""
        where = f" ({source})" if source else ""
        if self.fingerprint != fingerprint:
            raise SkewArtifactError(
                f"skew artifact{where} was computed for another model (fingerprint {self.fingerprint[:16]}…, "
                f"this model {fingerprint[:16]}…): recompute it with `infinigen skew` for this model"
            )
        if not math.isclose(self.partial_ratio, partial_ratio) or self.skewed != skewed:
            raise SkewArtifactError(
                f"skew artifact{where} has partial_ratio={self.partial_ratio}, skew={self.skewed}; "
                f"the configuration asks for partial_ratio={partial_ratio}, skew={skewed}"
            )
        if len(self.channels) != num_layers:
            raise SkewArtifactError(
                f"skew artifact{where} covers {len(self.channels)} layers, the model has {num_layers}"
            )


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the model's config and every weight: a changed model never reuses a skew."""
    cached = getattr(model, "_infinigen_fingerprint", None)
    if cached is not None:
        return cached
    h = hashlib.blake2b(digest_size=20)
    cfg = model.config.to_dict()
    for volatile in (
        "_name_or_path",
        "transformers_version",
        "_attn_implementation_autoset",
        "_attn_implementation",
        "attn_implementation",
        "quantization_config",
        "dtype",
        "torch_dtype",
        "_commit_hash",
    ):
        cfg.pop(volatile, None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        t = p.detach().to("cpu").contiguous()
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def default_cache_dir() -> Path:
    env = os.environ.get("INFINIGEN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "infinigen"


def artifact_path(cache_dir: Path, model_type: str, fingerprint: str, ratio: float, skewed: bool, tokens: int) -> Path:
    tag = "skew" if skewed else "noskew"
    return cache_dir / "skew" / f"{model_type}-{fingerprint[:20]}-r{ratio:.3f}-{tag}-t{tokens}.safetensors"


def calibration_text() -> str:
    """The calibration prose shipped with the package (Milton, *Areopagitica*, 1644; public domain)."""
    return resources.files("infinigen.data").joinpath("areopagitica.txt").read_text(encoding="utf-8")


def default_calibration_tokens(adapter: ModelAdapter) -> int:
    return int(min(adapter.max_positions, MAX_DEFAULT_CALIBRATION))


def calibration_ids(tokenizer, num_tokens: int, text: str | None = None) -> torch.Tensor:
    """`num_tokens` ids of real prose: the end of the shipped text (its opening is the demo
    prompt, so the two never overlap), repeated if the model's context is longer."""
    text = text if text is not None else calibration_text()
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() < num_tokens:
        ids = ids.repeat(math.ceil(num_tokens / ids.numel()))
        return ids[:num_tokens][None]
    return ids[-num_tokens:][None]


def synthetic_calibration_ids(vocab_size: int, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Seeded random ids, for models that come without a tokenizer (tiny test models)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=g)


def _channel_count(ratio: float, head_dim: int) -> int:
    return max(1, min(head_dim, round(ratio * head_dim)))


@torch.no_grad()
def collect_qk(model: nn.Module, adapter: ModelAdapter, input_ids: torch.Tensor, progress: bool = True):
    """Run the model once and capture, per layer, its queries and keys as the dot product
    sees them (post-RoPE), by recomputing them from each attention module's normalized input."""
    mods = adapter.attention_modules()
    qs: dict[int, torch.Tensor] = {}
    ks: dict[int, torch.Tensor] = {}
    bar = tqdm(total=len(mods), desc="calibrating skew", unit="layer", disable=not progress)
    handles = []
    for i, mod in enumerate(mods):

        def hook(module, args, kwargs, i=i):
            x = kwargs.get("hidden_states", args[0] if args else None)
            pe = kwargs.get("position_embeddings")
            qs[i] = adapter.queries(i, x, pe)[0].to(torch.float32).cpu()  # [H, T, d]
            ks[i] = adapter.keys(i, x, pe)[0].to(torch.float32).cpu()  # [Hkv, T, d]
            bar.update(1)

        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        device = next(model.parameters()).device
        model(input_ids=input_ids.to(device), use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
        bar.close()
    return qs, ks


def skew_from_qk(q: torch.Tensor, k: torch.Tensor, num_kv_heads: int, ratio: float, skewed: bool):
    """Skew and channels of one layer. q: [H, T, d]; k: [Hkv, T, d]."""
    h, t, d = q.shape
    group = h // num_kv_heads
    c = _channel_count(ratio, d)
    skews, chans = [], []
    for g in range(num_kv_heads):
        qg = q[g * group : (g + 1) * group].reshape(-1, d).to(torch.float64)  # group queries stacked
        kg = k[g].to(torch.float64)
        if skewed:
            _, _, vh = torch.linalg.svd(qg, full_matrices=False)
            a = vh.transpose(0, 1)  # columns: right singular vectors, largest first
        else:
            a = torch.eye(d, dtype=torch.float64)
        mass = (qg @ a).abs().sum(0) + (kg @ a).abs().sum(0)
        chans.append(torch.topk(mass, c).indices.sort().values)
        skews.append(a.to(torch.float32))
    return torch.stack(skews), torch.stack(chans).to(torch.long)


def calibrate(
    model: nn.Module,
    adapter: ModelAdapter,
    input_ids: torch.Tensor,
    partial_ratio: float,
    skewed: bool = True,
    fingerprint: str | None = None,
    progress: bool = True,
) -> SkewArtifact:
    """Compute the skew artifact of a (not yet folded) model from calibration ids [1, T]."""
    qs, ks = collect_qk(model, adapter, input_ids, progress=progress)
    skews: dict[int, torch.Tensor | None] = {}
    channels: dict[int, torch.Tensor] = {}
    for i in range(adapter.num_layers):
        a, c = skew_from_qk(qs[i], ks[i], adapter.num_kv_heads, partial_ratio, skewed)
        skews[i] = a if skewed else None
        channels[i] = c
    return SkewArtifact(
        skews=skews,
        channels=channels,
        fingerprint=fingerprint or model_fingerprint(model),
        partial_ratio=float(partial_ratio),
        skewed=skewed,
        calibration_tokens=int(input_ids.shape[-1]),
        meta={"model_type": str(model.config.model_type)},
    )


def query_mass_in_channels(q: torch.Tensor, skew: torch.Tensor | None, channels: torch.Tensor) -> float:
    """Fraction of Σ q² held by `channels` after the skew (q: [H, T, d], GQA-grouped)."""
    hkv = channels.shape[0]
    group = q.shape[0] // hkv
    kept, total = 0.0, 0.0
    for g in range(hkv):
        qg = q[g * group : (g + 1) * group].reshape(-1, q.shape[-1]).to(torch.float64)
        if skew is not None:
            qg = qg @ skew[g].to(torch.float64)
        sq = qg.pow(2)
        kept += sq[:, channels[g]].sum().item()
        total += sq.sum().item()
    return kept / total
