"""Model adapters, one small class per family."""

from __future__ import annotations

from torch import nn

from infinigen.models.base import ModelAdapter, UnsupportedModelError
from infinigen.models.llama import LlamaLikeAdapter
from infinigen.models.opt import OPTAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {
    "llama": LlamaLikeAdapter,
    "qwen2": LlamaLikeAdapter,
    "mistral": LlamaLikeAdapter,
    "opt": OPTAdapter,
}


def get_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter for `model`, or a clear error naming what is supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type](model)


__all__ = ["ADAPTERS", "ModelAdapter", "UnsupportedModelError", "get_adapter"]
