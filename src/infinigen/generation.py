"""One generation run with timing and the cache's counters: what the CLI and the demo print."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from infinigen.api import attach
from infinigen.cache import ContextTooLongError
from infinigen.compat import cache_kwargs
from infinigen.config import InfiniGenConfig
from infinigen.errors import InputError
from infinigen.models import get_adapter
from infinigen.prefill import PREFILL_CHUNK, Prefix, chunked_prefill


class _StepClock(StoppingCriteria):
    """Records the wall time of every generation step (never stops anything); with `progress`,
    shows a "decoding" bar on stderr from the first new token (the prompt is in the cache then)."""

    def __init__(self, total: int = 0, progress: bool = False) -> None:
        self.times: list[float] = []
        self.total, self.progress = total, progress
        self.bar = None

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        if self.progress:
            if self.bar is None:
                self.bar = tqdm(total=self.total, desc="decoding", unit="token", leave=False)
            self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class RunResult:
    policy: str
    text: list[str]
    new_tokens: int
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    tokens_per_s: float
    summary: dict[str, Any]
    config: dict[str, Any]
    token_ids: list[list[int]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        s = self.summary
        return {
            "text": self.text[0] if len(self.text) == 1 else self.text,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "tokens_per_s": self.tokens_per_s,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "fetched_fraction": s["fetched_fraction"],
            "bytes_fetched_per_token": s["bytes_fetched_per_token"],
            "bytes_fetched": s["bytes_fetched"],
            "speculation_seconds": s["speculation_seconds"],
            "compute_kv_bytes": s["compute_kv_bytes"],
            "dense_kv_bytes": s["dense_kv_bytes"],
            "memory": s["memory"],
            "policy": self.policy,
            "config": self.config,
            "per_layer_fetched_fraction": [p["fetched_fraction"] for p in s["per_layer"]],
        }


def _check_prefix(prefix: Prefix, enc, cache) -> None:
    """Refuse, in one sentence, a prefix that is not every row's prompt, or a policy whose
    prefill is more than dense attention."""
    ids = enc.input_ids
    same = (
        prefix.ids is not None
        and prefix.length == ids.shape[1]
        and bool(enc.attention_mask.all())
        and bool((ids == prefix.ids.to(ids.device)).all())
    )
    if not same:
        raise InputError(
            f"the prefix was computed from other tokens than these prompts: it replays the {prefix.length} tokens "
            "it was computed from, as every row's prompt"
        )
    if cache.selector is not None and cache.selector.watches_prefill and prefix.column_sums is None:
        raise InputError(
            f"policy {cache.selector.name} reads the prefill's attention: it must run its own prefill, or be replayed a "
            "prefix that carries the prompt's attention column sums (`prompt_column_sums`)"
        )


def prompt_column_sums(model, ids: torch.Tensor, progress: bool = False) -> dict[int, torch.Tensor]:
    """Per global layer, the column sums [1, Hkv, T] of a dense prefill's attention over `ids`
    [1, T], through a dense session of its own: what a prefix replayed into H2O's cache carries
    (`Prefix.column_sums`) so that it sees the prompt's attention as its own prefill would."""
    from infinigen.measure.forced import column_sums_through

    with attach(model, InfiniGenConfig(policy="dense"), progress=False) as session:
        return column_sums_through(session, ids, progress)


def check_context(model, prompt_tokens: int, max_new_tokens: int) -> None:
    limit = get_adapter(model).max_positions
    if prompt_tokens + max_new_tokens > limit:
        raise ContextTooLongError(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {limit} positions"
        )


@torch.no_grad()
def run_generation(
    model,
    tokenizer,
    prompts: list[str],
    config: InfiniGenConfig,
    max_new_tokens: int = 64,
    progress: bool = True,
    skew=None,
    prefix: Prefix | None = None,
) -> RunResult:
    """Greedy generation under `config` (left padding for a batch), inside its own attach
    session: the model is as it was once this returns, however it returns.

    prefix: the prompt's KV and its greedy next token, computed once (`prefill.dense_prefix`) for
    prompts that are all that one prompt; replayed into the cache instead of a prefill (whose
    dense attention would compute the same), and the next token is the first new one
    (`prefill_seconds` is then the replay's). Only for a policy whose prefill attends densely, or
    one that watches it (H2O) when the prefix carries the prompt's attention column sums."""
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    prompt_tokens = int(enc.input_ids.shape[1])
    if prompt_tokens == 0:
        raise InputError("the prompt is empty: the tokenizer made no tokens of it")
    check_context(model, prompt_tokens, max_new_tokens)
    clock = _StepClock(max_new_tokens, progress)
    with contextlib.closing(clock), attach(model, config, skew=skew, tokenizer=tokenizer, progress=progress) as session:
        # The tiers and their files are released however generation ends (Ctrl-C, SIGTERM included).
        with session.new_cache(max_length=prompt_tokens + max_new_tokens, batch=len(prompts)) as cache:
            start = time.perf_counter()
            inputs, todo = dict(enc), max_new_tokens
            if prefix is not None:
                _check_prefix(prefix, enc, cache)
                prefix.replay(cache, len(prompts))
                # The prefill's token is the first new one; generate goes on from it.
                clock(enc.input_ids, None)
                first = prefix.next_token.to(enc.input_ids.device).expand(len(prompts))[:, None]
                ids = torch.cat([enc.input_ids, first], dim=1)
                inputs, todo = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, max_new_tokens - 1
            elif prompt_tokens > PREFILL_CHUNK and bool(enc.attention_mask.all()):
                # A long prompt (no padding) is prefilled in chunks; generate goes on from the cache.
                chunked_prefill(model, enc.input_ids[:, :-1], cache, logits_to_keep=1, progress=progress)
            out = inputs["input_ids"]
            if todo > 0:
                out = model.generate(
                    **inputs,
                    max_new_tokens=todo,
                    min_new_tokens=todo,
                    do_sample=False,
                    **cache_kwargs(model, cache),
                    stopping_criteria=StoppingCriteriaList([clock]),
                    pad_token_id=tokenizer.pad_token_id,
                )
            summary = cache.summary()
    new = out[:, prompt_tokens:]
    first = clock.times[0] if clock.times else time.perf_counter()
    last = clock.times[-1] if clock.times else first
    decode_steps = max(len(clock.times) - 1, 0)
    decode_seconds = last - first
    tps = decode_steps * new.shape[0] / decode_seconds if decode_seconds > 0 else float("nan")
    return RunResult(
        policy=config.policy,
        text=tokenizer.batch_decode(new, skip_special_tokens=True),
        new_tokens=int(new.shape[1]),
        prompt_tokens=prompt_tokens,
        prefill_seconds=first - start,
        decode_seconds=decode_seconds,
        tokens_per_s=tps,
        summary=summary,
        config=config.to_dict(),
        token_ids=new.tolist(),
    )
