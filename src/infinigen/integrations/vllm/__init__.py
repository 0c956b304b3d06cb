"""InfiniGen inside vLLM (``pip install 'infinigen-kv[vllm]'``): a ``vllm.general_plugins`` entry
point (`plugin.register`) that, with ``INFINIGEN_VLLM`` set, serves vLLM's CPU attention with
InfiniGen: vLLM's page holds only the partial keys, the full K/V lives in a slow tier keyed by
vLLM's slots, and each decode step of a speculated layer attends only the rows the previous
layer's input speculated. Nothing here imports vLLM until the plugin turns on."""
