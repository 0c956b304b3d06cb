"""One vLLM process's plugin state: its settings, the hooked model, and the runtime built at the
first attention call (when vLLM's pool and the model both exist).

vLLM imports this through the ``vllm.general_plugins`` entry point (`register`) in every
process; nothing changes unless ``INFINIGEN_VLLM`` is set (`infinigen.integrations.vllm.settings`).
"""

from __future__ import annotations

import threading

import torch

from infinigen.integrations.vllm.runtime import Adapter, Runtime
from infinigen.integrations.vllm.settings import PluginSettings, from_env

BACKEND = "infinigen.integrations.vllm.backend.InfiniGenBackend"
MODEL = "infinigen.integrations.vllm.model:InfiniGenLlamaForCausalLM"

_lock = threading.Lock()
_settings: PluginSettings | None = None
_model = None
_runtime: Runtime | None = None
_engine = None  # the backend's prompt attention (vLLM's own kernel)
_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def register() -> None:
    """The entry point: with ``INFINIGEN_VLLM`` set, route vLLM's CPU attention to InfiniGen's
    backend and the Llama family to the same model with the speculation's input hooks."""
    global _settings
    _settings = from_env()
    if _settings is None:
        return
    import vllm
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from infinigen.integrations.vllm import details

    details.check_version(vllm.__version__)
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    for arch in details.ARCHITECTURES:
        ModelRegistry.register_model(arch, MODEL)


def settings() -> PluginSettings:
    global _settings
    if _settings is None:
        _settings = from_env()
    if _settings is None:
        raise RuntimeError("infinigen's vLLM backend runs only with INFINIGEN_VLLM set")
    return _settings


def model_built(model) -> None:
    """The Llama subclass's call once built: hook every attention module's input."""
    global _model
    from infinigen.attach import watch_inputs
    from infinigen.integrations.vllm import details

    _model = model
    watch_inputs(details.attention_modules(model), _saw_input)


def _saw_input(layer: int, args: tuple, kwargs: dict) -> None:
    if layer == 0:  # a new step: nothing of the last one is read again
        _inputs.clear()
    positions = kwargs.get("positions", args[0] if args else None)
    hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
    _inputs[layer] = (hidden, positions)


def runtime(vllm_config, kv_cache: torch.Tensor, scale: float) -> Runtime:
    """The process's runtime, built at the first attention call with vLLM's pool in hand."""
    global _runtime
    if _runtime is not None:
        return _runtime
    with _lock:
        if _runtime is None:
            _runtime = _build(vllm_config, kv_cache, scale)
    return _runtime


def set_engine(engine) -> None:
    """The backend's prompt attention, which the runtime calls for prompts (`backend.VllmPrompts`)."""
    global _engine
    _engine = engine
    if _runtime is not None:
        _runtime.engine = engine


def current() -> Runtime | None:
    """The runtime if built (what a benchmark in this process reads its counters from)."""
    return _runtime


def _build(vllm_config, kv_cache: torch.Tensor, scale: float) -> Runtime:
    from infinigen.integrations.vllm import details

    s = settings()
    if _model is None:
        raise details.UnsupportedVllmError(
            "infinigen's vLLM plugin did not see the model built (not a Llama-family model?)"
        )
    mc = vllm_config.model_config
    modules = details.attention_modules(_model)
    rotaries = [details.rotary(m) for m in modules]
    by_embedding: dict[int, tuple | None] = {}  # layers usually share one rotary embedding (one table)
    tables = [by_embedding.setdefault(id(m.rotary_emb), details.rope_table(m)) for m in modules]
    hf = mc.hf_config
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    adapter = Adapter(
        len(modules), heads, kv_heads, head_dim, scale, lambda i, pos, q: rotaries[i](pos, q), lambda i: tables[i]
    )
    config = s.config.in_read_units(head_dim, mc.dtype)
    artifact = None
    if s.keeps_partial_keys:
        from infinigen.integrations.vllm.calibrated import artifact_for

        artifact = artifact_for(mc.model, config, s.artifact)
    block_size = kv_cache.shape[2]
    runtime = Runtime(
        PluginSettings(config, s.artifact), adapter, artifact, block_size, kv_cache.shape[0] * block_size, mc.dtype
    )
    runtime.inputs = _inputs
    runtime.engine = _engine
    return runtime
