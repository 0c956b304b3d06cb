"""The skew artifact: per-layer skew matrices and partial channels, saved as safetensors and
keyed by a fingerprint of the model, so that a changed model or changed settings never reuse it.

The file also carries a checksum of its own contents (every tensor and every metadata entry),
verified on load: a file damaged on disk is refused, never used. It is written to an unnamed
(or temporary) file in the same folder and renamed over the target only once complete, so a
crash or Ctrl-C during a save leaves the previous artifact or none, never half of one."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as to_bytes
from torch import nn

from infinigen.errors import InfiniGenError

FORMAT_VERSION = "3"  # 2: with a checksum of the contents; 3: with the oracle's recall curves
_REQUIRED = ("fingerprint", "partial_ratio", "skewed", "calibration_tokens", "checksum")


class SkewArtifactError(InfiniGenError, ValueError):
    """A skew artifact that cannot be used: unreadable, damaged, of an old format, or made for
    another model or other settings. `path` is its file (None for one in memory); `reason` is
    what is wrong with it, without the way out that the message adds; `sound` says the file is a
    good artifact of another model or other settings, which the way out must not overwrite."""

    def __init__(
        self, message: str, path: str | os.PathLike | None = None, reason: str | None = None, sound: bool = False
    ) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.reason = reason or message
        self.sound = sound


def checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """Hash of every tensor (name, dtype, shape, bytes) and metadata entry but the checksum itself."""
    h = hashlib.blake2b(digest_size=20)
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy()))
    for key in sorted(meta):
        if key != "checksum":
            h.update(f"{key}={meta[key]}|".encode())
    return h.hexdigest()


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that `path` is either as before or complete: into an unnamed
    file (``O_TMPFILE``; a temporary one where refused) in the same folder, synced, then linked
    and renamed over `path`. A temporary name exists only between link and rename (unnamed) or
    while writing (fallback), and is removed if anything, Ctrl-C included, interrupts."""
    folder = path.parent
    tmp = folder / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = dirfd = -1
    try:
        unnamed = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")
        if unnamed:
            try:
                fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o644)
            except OSError:
                unnamed = False
        if not unnamed:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        if unnamed:  # linkat(AT_SYMLINK_FOLLOW) of the descriptor: the file gets its first name
            dirfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            os.link(f"/proc/self/fd/{fd}", tmp.name, dst_dir_fd=dirfd, follow_symlinks=True)
        os.replace(tmp, path)
    finally:
        for d in (fd, dirfd):
            if d >= 0:
                os.close(d)
        tmp.unlink(missing_ok=True)


@dataclass
class SkewArtifact:
    """Per-layer skew A [Hkv, d, d] (None: identity) and partial channels [Hkv, c]; and, from
    the same calibration, each layer's oracle recall curve (mean attention mass held by the
    true top fraction f of the context, at each f of `recall_grid`), from which the selector
    spreads a budget over the layers (`speculate.allocate_budgets`).

    Also from the same calibration (optional: artifacts made before it lack them, and then serve
    only uniform channel counts): every layer's channels ranked [Hkv, d] (`channel_orders`) and
    the recall of speculating with the top c of them at each c of `channel_grid`
    (`channel_recall`), from which the selector spreads the channels over the layers
    (`speculate.allocate_channels`, knob `channel_allocation`). Likewise optional: every
    layer's query map fitted to the previous layer's input [D + 1, H·d] (`query_maps`, knob
    `speculate_from` "fitted", `infinigen.skew.query_map`). And every global layer's table for
    choosing its correction (knob `correction` None): its attention output's error under
    speculate-then-correct at each budget of `correction_budgets` and share of
    `correction_shares`, per input of `SPECULATED_INPUTS` ([2, budgets, shares],
    `correction_errors`), and the oracle's at each budget (`oracle_errors`)."""

    skews: dict[int, torch.Tensor | None]
    channels: dict[int, torch.Tensor]
    fingerprint: str
    partial_ratio: float
    skewed: bool
    calibration_tokens: int
    meta: dict[str, str] = field(default_factory=dict)
    recall_curves: dict[int, torch.Tensor] = field(default_factory=dict)
    recall_grid: torch.Tensor | None = None
    channel_orders: dict[int, torch.Tensor] = field(default_factory=dict)
    channel_recall: dict[int, torch.Tensor] = field(default_factory=dict)
    channel_grid: torch.Tensor | None = None
    query_maps: dict[int, torch.Tensor] = field(default_factory=dict)
    correction_errors: dict[int, torch.Tensor] = field(default_factory=dict)
    oracle_errors: dict[int, torch.Tensor] = field(default_factory=dict)
    correction_budgets: torch.Tensor | None = None
    correction_shares: torch.Tensor | None = None
    # The cache file it was loaded from or saved to by calibration (not stored in it): where the
    # measured choice (`infinigen.skew.choice`) is saved once made. None: in memory, or a file the
    # user gave, which is never rewritten.
    origin: Path | None = field(default=None, compare=False, repr=False)

    def has_correction_tables(self) -> bool:
        """Whether this artifact was made by a calibration that measures the correction (older
        ones were not; layers without a table are the local ones and the first)."""
        return self.correction_budgets is not None and self.correction_shares is not None

    def has_query_maps(self) -> bool:
        """Whether this artifact can speculate through fitted query maps (every layer but the first)."""
        return set(self.query_maps) >= set(self.channels) - {0}

    def lacks(
        self, channel_allocation: str = "uniform", speculate_from: str = "previous", correction: float | None = 0.0
    ) -> str | None:
        """What these settings read beyond the skew and channels that this artifact does not
        hold (as the reason `verify` gives), or None."""
        if channel_allocation == "calibrated" and not self.has_channel_recall():
            return (
                "has no channel recall tables (made before per-layer channel counts), "
                "which channel_allocation=calibrated needs"
            )
        if speculate_from == "fitted" and not self.has_query_maps():
            return "has no query maps (made before fitted speculation), which speculate_from=fitted needs"
        if correction is None and not self.has_correction_tables():
            return (
                "has no correction tables (made before the calibrated correction), "
                "which correction=none (chosen per layer) needs"
            )
        return None

    def serves(
        self, channel_allocation: str = "uniform", speculate_from: str = "previous", correction: float | None = 0.0
    ) -> bool:
        """Whether it holds what these settings read beyond the skew and channels."""
        return self.lacks(channel_allocation, speculate_from, correction) is None

    def has_channel_recall(self) -> bool:
        """Whether this artifact can spread channels over the layers (`channel_allocation`)."""
        layers = set(self.channels)
        return (
            self.channel_grid is not None and set(self.channel_orders) >= layers and set(self.channel_recall) >= layers
        )

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"layer.{i}.channels": c.contiguous() for i, c in self.channels.items()}
        for i, a in self.skews.items():
            if a is not None:
                tensors[f"layer.{i}.skew"] = a.to(torch.float32).contiguous()
        for i, curve in self.recall_curves.items():
            tensors[f"layer.{i}.recall"] = curve.to(torch.float32).contiguous()
        if self.recall_grid is not None:
            tensors["recall_grid"] = self.recall_grid.to(torch.float32).contiguous()
        for i, order in self.channel_orders.items():
            tensors[f"layer.{i}.channel_order"] = order.to(torch.long).contiguous()
        for i, table in self.channel_recall.items():
            tensors[f"layer.{i}.channel_recall"] = table.to(torch.float32).contiguous()
        if self.channel_grid is not None:
            tensors["channel_grid"] = self.channel_grid.to(torch.long).contiguous()
        for i, m in self.query_maps.items():
            tensors[f"layer.{i}.query_map"] = m.contiguous()
        for i, e in self.correction_errors.items():
            tensors[f"layer.{i}.correction_error"] = e.to(torch.float32).contiguous()
        for i, e in self.oracle_errors.items():
            tensors[f"layer.{i}.oracle_error"] = e.to(torch.float32).contiguous()
        for name in ("correction_budgets", "correction_shares"):
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name).to(torch.float32).contiguous()
        meta = dict(self.meta)
        meta.pop("checksum", None)
        meta.update(
            format_version=FORMAT_VERSION,
            fingerprint=self.fingerprint,
            partial_ratio=repr(float(self.partial_ratio)),
            skewed=str(bool(self.skewed)),
            calibration_tokens=str(self.calibration_tokens),
        )
        meta["checksum"] = checksum(tensors, meta)
        write_atomically(path, to_bytes(tensors, metadata=meta))

    @classmethod
    def load(cls, path: str | os.PathLike) -> SkewArtifact:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise SkewArtifactError(f"skew artifact not found: {path}", path, "was not found")

        def refuse(reason: str) -> SkewArtifactError:
            return SkewArtifactError(f"skew artifact {path} {reason}", path, reason)

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
            tensors = load_file(str(path))
        except Exception as exc:  # truncated, damaged header, or not a safetensors file
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise refuse(f"cannot be read ({first})") from exc
        if meta.get("format_version") != FORMAT_VERSION:
            raise refuse(f"has format {meta.get('format_version')!r}, expected {FORMAT_VERSION!r} (an older version)")
        missing = [k for k in _REQUIRED if k not in meta]
        if missing:
            raise refuse(f"is incomplete (no {', '.join(missing)} in its metadata)")
        if meta["checksum"] != checksum(tensors, meta):
            raise refuse("is damaged (its contents do not match their checksum)")
        try:
            layers = sorted({int(k.split(".")[1]) for k in tensors if k.endswith(".channels")})
            skews = {i: tensors.get(f"layer.{i}.skew") for i in layers}
            channels = {i: tensors[f"layer.{i}.channels"] for i in layers}
            curves = {i: tensors[f"layer.{i}.recall"] for i in layers if f"layer.{i}.recall" in tensors}
            orders = {i: tensors[k] for i in layers if (k := f"layer.{i}.channel_order") in tensors}
            tables = {i: tensors[k] for i in layers if (k := f"layer.{i}.channel_recall") in tensors}
            maps = {i: tensors[k] for i in layers if (k := f"layer.{i}.query_map") in tensors}
            corrections = {i: tensors[k] for i in layers if (k := f"layer.{i}.correction_error") in tensors}
            oracle_errors = {i: tensors[k] for i in layers if (k := f"layer.{i}.oracle_error") in tensors}
            ratio, tokens = float(meta["partial_ratio"]), int(meta["calibration_tokens"])
        except (ValueError, KeyError, IndexError) as exc:
            raise refuse(f"is malformed ({exc})") from exc
        return cls(
            skews=skews,
            channels=channels,
            fingerprint=meta["fingerprint"],
            partial_ratio=ratio,
            skewed=meta["skewed"] == "True",
            calibration_tokens=tokens,
            meta={k: v for k, v in meta.items() if k not in {"fingerprint", "partial_ratio", "skewed", "checksum"}},
            recall_curves=curves,
            recall_grid=tensors.get("recall_grid"),
            channel_orders=orders,
            channel_recall=tables,
            channel_grid=tensors.get("channel_grid"),
            query_maps=maps,
            correction_errors=corrections,
            oracle_errors=oracle_errors,
            correction_budgets=tensors.get("correction_budgets"),
            correction_shares=tensors.get("correction_shares"),
        )

    def verify(
        self,
        fingerprint: str,
        partial_ratio: float,
        skewed: bool,
        num_layers: int,
        path: str | os.PathLike | None = None,
        channel_allocation: str = "uniform",
        speculate_from: str = "previous",
        correction: float | None = 0.0,
    ) -> None:
        """Refuse an artifact made for another model or other settings (`path`: its file, if any);
        for `channel_allocation` "calibrated", also one without the channel recall tables; for
        `speculate_from` "fitted", one without the query maps; for `correction` None, one without
        the correction tables."""

        def refuse(reason: str, sound: bool = False) -> SkewArtifactError:
            where = "" if path is None else f" {path}"
            return SkewArtifactError(f"skew artifact{where} {reason}", path, reason, sound)

        if self.fingerprint != fingerprint:
            raise refuse(
                f"was computed for another model (fingerprint {self.fingerprint[:16]}…, this model {fingerprint[:16]}…)",
                sound=True,
            )
        if not math.isclose(self.partial_ratio, partial_ratio) or self.skewed != skewed:
            raise refuse(
                f"has partial_ratio={self.partial_ratio}, skew={self.skewed}; "
                f"the configuration asks for partial_ratio={partial_ratio}, skew={skewed}",
                sound=True,
            )
        if sorted(self.channels) != list(range(num_layers)):
            raise refuse(f"covers {len(self.channels)} layers, the model has {num_layers}", sound=True)
        missing = self.lacks(channel_allocation, speculate_from, correction)
        if missing is not None:
            raise refuse(missing)


def needs_of(knobs) -> dict:
    """What settings `knobs` (a config or InfiniGen's knobs) read from an artifact beyond the skew
    and channels, as `lacks`, `serves` and `verify` take them (defaults for other knobs)."""
    return dict(
        channel_allocation=getattr(knobs, "channel_allocation", "uniform"),
        speculate_from=getattr(knobs, "speculate_from", "previous"),
        correction=getattr(knobs, "correction", 0.0),
    )


def model_fingerprint(model: nn.Module, exact: bool = False) -> str:
    """Hash of the model's config and every weight: a changed model never reuses a skew.

    Floating-point weights are hashed rounded to bfloat16, so that a model's float32 and bfloat16
    copies share one artifact (calibrating costs minutes; the skew is a statistic of the queries,
    which no rounding finer than bfloat16's moves). A float16 copy keeps its own: its weights were
    rounded once more on the way. `exact`: the bytes as stored, how artifacts were keyed before
    (`infinigen.skew.adopted`; for a bfloat16 model the two are the same)."""
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
        t = p.detach()
        if not exact and t.is_floating_point():
            t = t.to(torch.bfloat16)
        t = t.to("cpu").contiguous()
        h.update(str(t.dtype).encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.hexdigest()


def artifact_path(cache_dir: Path, model_type: str, fingerprint: str, ratio: float, skewed: bool, tokens: int) -> Path:
    tag = "skew" if skewed else "noskew"
    return cache_dir / "skew" / f"{model_type}-{fingerprint[:20]}-r{ratio:.3f}-{tag}-t{tokens}.safetensors"
