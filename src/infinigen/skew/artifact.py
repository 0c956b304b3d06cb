"""The skew artifact: per-layer skew matrices and partial channels, saved as safetensors and
keyed by a fingerprint of the model, so that a changed model or changed settings never reuse it."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from infinigen.errors import InfiniGenError

FORMAT_VERSION = "1"


class SkewArtifactError(InfiniGenError, ValueError):
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
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.hexdigest()


def artifact_path(cache_dir: Path, model_type: str, fingerprint: str, ratio: float, skewed: bool, tokens: int) -> Path:
    tag = "skew" if skewed else "noskew"
    return cache_dir / "skew" / f"{model_type}-{fingerprint[:20]}-r{ratio:.3f}-{tag}-t{tokens}.safetensors"
