"""Model adapters, one small class per family."""

from __future__ import annotations

from torch import nn

from infinigen.models.base import ModelAdapter, UnsupportedModelError
from infinigen.models.gemma3 import Gemma3Adapter
from infinigen.models.llama import LlamaLikeAdapter
from infinigen.models.opt import OPTAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {
    "llama": LlamaLikeAdapter,
    "qwen2": LlamaLikeAdapter,
    "qwen3": LlamaLikeAdapter,
    "mistral": LlamaLikeAdapter,
    "gemma3_text": Gemma3Adapter,
    "opt": OPTAdapter,
}

# Why some families that look close are not supported (what the adapter would have to model).
HINTS: dict[str, str] = {
    "gemma3": " (the multimodal Gemma-3; load its text model, Gemma3ForCausalLM, model type gemma3_text)",
    "gemma2": " (its attention soft-caps the logits, which the selected-rows attention does not model)",
    "gpt2": " (absolute positions and a fused qkv projection)",
}


def unsupported(model_type: str | None, where: str = "") -> UnsupportedModelError:
    """The error for a family no adapter drives, naming the supported ones (`where`: e.g. " in
    FOLDER", for a model folder refused before its weights are read)."""
    hint = HINTS.get(model_type, "")
    return UnsupportedModelError(
        f"model type {model_type!r}{where} is not supported{hint}; supported: {', '.join(sorted(ADAPTERS))}"
    )


def get_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter for `model`, or a clear error naming what is supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise unsupported(model_type)
    return ADAPTERS[model_type](model)


__all__ = ["ADAPTERS", "ModelAdapter", "UnsupportedModelError", "get_adapter", "unsupported"]
