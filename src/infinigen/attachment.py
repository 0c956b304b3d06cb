"""Attach InfiniGen to a model: hooks, attention implementation, skew; detach restores all."""

from __future__ import annotations

import functools
import math
from pathlib import Path

from torch import nn

from infinigen.config import InfiniGenConfig
from infinigen.models import ModelAdapter, get_adapter
from infinigen.skew import (
    SkewArtifact,
    artifact_path,
    calibrate,
    calibration_ids,
    default_cache_dir,
    default_calibration_tokens,
    model_fingerprint,
    synthetic_calibration_ids,
)

_ATTR = "_infinigen_attachment"


class Attachment:
    """What `attach` changed on a model, so that `detach` can undo exactly that."""

    def __init__(
        self,
        model: nn.Module,
        config: InfiniGenConfig,
        skew: SkewArtifact | str | Path | None = None,
        tokenizer=None,
        cache_dir: str | Path | None = None,
        progress: bool = True,
    ) -> None:
        from infinigen.cache import ATTN_NAME, register_attention

        self.model = model
        self.config = config
        self.adapter: ModelAdapter = get_adapter(model)  # raises for unsupported families
        self.tokenizer = tokenizer
        self.folded = False
        self.artifact: SkewArtifact | None = None
        self._handles: list = []
        self._orig_attn = model.config._attn_implementation
        self._orig_generate = None
        self.fingerprint = model_fingerprint(model)
        self.explicit_skew = skew is not None
        if config.policy == "infinigen":
            self.artifact = self._load_or_calibrate(skew, cache_dir, progress)
        register_attention()
        model.set_attn_implementation(ATTN_NAME)
        for i, mod in enumerate(self.adapter.attention_modules()):
            self._handles.append(
                mod.register_forward_pre_hook(functools.partial(_pre_hook, layer_idx=i), with_kwargs=True)
            )
            self._handles.append(mod.register_forward_hook(_post_hook))
        if self.artifact is not None and not self.adapter.has_rope and self.artifact.skewed:
            self.adapter.fold_skew({i: a for i, a in self.artifact.skews.items() if a is not None})
            self.folded = True
            model._infinigen_fingerprint = self.fingerprint  # the folded weights keep the original identity
        setattr(model, _ATTR, self)

    # ------------------------------------------------------------------ skew
    def _load_or_calibrate(self, skew, cache_dir, progress: bool) -> SkewArtifact:
        cfg = self.config
        if isinstance(skew, SkewArtifact):
            skew.verify(self.fingerprint, cfg.partial_ratio, cfg.skew, self.adapter.num_layers, "given artifact")
            return skew
        if skew is not None:
            art = SkewArtifact.load(skew)
            art.verify(self.fingerprint, cfg.partial_ratio, cfg.skew, self.adapter.num_layers, str(skew))
            return art
        tokens = cfg.calibration_tokens or default_calibration_tokens(self.adapter)
        tokens = min(tokens, self.adapter.max_positions)
        cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        path = artifact_path(
            cache_dir, self.model.config.model_type, self.fingerprint, cfg.partial_ratio, cfg.skew, tokens
        )
        if path.is_file():
            art = SkewArtifact.load(path)
            art.verify(self.fingerprint, cfg.partial_ratio, cfg.skew, self.adapter.num_layers, str(path))
            return art
        if self.tokenizer is not None:
            ids = calibration_ids(self.tokenizer, tokens)
        else:
            ids = synthetic_calibration_ids(self.model.config.vocab_size, tokens)
        art = calibrate(self.model, self.adapter, ids, cfg.partial_ratio, cfg.skew, self.fingerprint, progress)
        try:
            art.save(path)
        except OSError as exc:
            import warnings

            warnings.warn(
                f"could not save the skew artifact to {path} ({exc}); it will be recomputed next time", stacklevel=2
            )
        return art

    def compatible(self, config: InfiniGenConfig) -> bool:
        """Can a cache with `config` reuse this attachment (same skew, same calibration)?"""
        if config.policy != "infinigen":
            return True
        if self.artifact is None:
            return False
        same = math.isclose(self.artifact.partial_ratio, config.partial_ratio) and self.artifact.skewed == config.skew
        if self.explicit_skew:
            return same
        tokens = min(config.calibration_tokens or default_calibration_tokens(self.adapter), self.adapter.max_positions)
        return same and self.artifact.calibration_tokens == tokens

    # ------------------------------------------------------------------ public
    def new_cache(self, config: InfiniGenConfig | None = None):
        from infinigen.cache import InfiniGenCache

        return InfiniGenCache(self.model, config or self.config)

    def detach(self) -> None:
        """Remove hooks, restore the attention implementation and unfold any folded skew."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.folded and self.artifact is not None:
            self.adapter.unfold_skew({i: a for i, a in self.artifact.skews.items() if a is not None})
            self.folded = False
            if hasattr(self.model, "_infinigen_fingerprint"):
                del self.model._infinigen_fingerprint
        if self._orig_generate is not None:
            del self.model.generate
            self._orig_generate = None
        self.model.set_attn_implementation(self._orig_attn)
        for mod in self.adapter.attention_modules():
            mod._infinigen_cache = None
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()


def _pre_hook(module: nn.Module, args, kwargs, layer_idx: int):
    """Before layer i's attention: hand the cache to the attention function and, during
    decode, speculate layer i+1 from this layer's normalized input."""
    from infinigen.cache import InfiniGenCache

    cache = kwargs.get("past_key_values")
    if not isinstance(cache, InfiniGenCache):
        module._infinigen_cache = None
        return None
    module._infinigen_cache = cache
    x = kwargs.get("hidden_states", args[0] if args else None)
    layer = cache.layers[layer_idx]
    past = layer.length
    if layer_idx == 0:
        cache.observe_mask(kwargs.get("attention_mask"), x.shape[0], past + x.shape[1], x.device)
    if x.shape[1] == 1 and past > 0 and cache.policy != "dense":
        pe = kwargs.get("position_embeddings")
        # Layer 0 (nothing earlier to overlap with) and policies that need this layer's own query.
        cache.prefetch(layer_idx, x, pe, own=True)
        if layer_idx + 1 < len(cache.layers):
            cache.prefetch(layer_idx + 1, x, pe)
    return None


def _post_hook(module: nn.Module, args, output):
    module._infinigen_cache = None  # never keep a finished generation's cache alive
    return None


def attach(
    model: nn.Module,
    config: InfiniGenConfig | None = None,
    skew: SkewArtifact | str | Path | None = None,
    tokenizer=None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> Attachment:
    """Attach InfiniGen to `model`; afterwards a plain ``model.generate(...)`` uses an
    InfiniGenCache. Returns a handle; ``handle.detach()`` (or a ``with`` block) undoes it."""
    config = config or InfiniGenConfig()
    old = getattr(model, _ATTR, None)
    if old is not None:
        old.detach()
    att = Attachment(model, config, skew=skew, tokenizer=tokenizer, cache_dir=cache_dir, progress=progress)
    orig = model.generate

    @functools.wraps(orig)
    def generate(*args, **kwargs):
        if kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = att.new_cache()
        return orig(*args, **kwargs)

    att._orig_generate = orig
    model.generate = generate
    return att


def detach(model: nn.Module) -> None:
    att = getattr(model, _ATTR, None)
    if att is not None:
        att.detach()


def ensure_attached(
    model: nn.Module, config: InfiniGenConfig, skew=None, tokenizer=None, progress: bool = True
) -> Attachment:
    """The model's attachment if it fits `config`, else a fresh one (hooks only, no generate wrap)."""
    att = getattr(model, _ATTR, None)
    if att is not None and skew is None and att.compatible(config):
        return att
    if tokenizer is None:
        tokenizer = att.tokenizer if att is not None else getattr(model, "_infinigen_tokenizer", None)
    if att is not None:
        att.detach()
    return Attachment(model, config, skew=skew, tokenizer=tokenizer, progress=progress)
