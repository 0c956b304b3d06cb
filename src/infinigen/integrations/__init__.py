"""Other tools as clients of InfiniGen's cache.

`infinigen.integrations.lm_eval`: the lm-evaluation-harness model type ``infinigen``
(``pip install 'infinigen-kv[eval]'``). Nothing is imported here: each integration imports its
own tool, so that `infinigen` itself never needs them.
"""
