"""The Llama family as vLLM builds it, with one addition: each attention module's input is
handed to the plugin before the module runs (layer i's input is what the speculation of layer
i + 1 reads). Registered under the same architecture names, so users load models as usual."""

from __future__ import annotations

from vllm.model_executor.models.llama import LlamaForCausalLM

from infinigen.integrations.vllm import plugin


class InfiniGenLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        plugin.model_built(self)
