"""`model.generate` inside attach: the wrapper that runs it on an InfiniGen cache, what it
refuses before any prefill (one sentence naming the alternative), and the size of the cache a
plain call plans from its arguments."""

from __future__ import annotations

import functools

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from infinigen.cache import ContextTooLongError, InfiniGenCache, SessionCache
from infinigen.compat import cache_in, with_cache
from infinigen.errors import InfiniGenError


class UnsupportedGenerationError(InfiniGenError, NotImplementedError):
    """A `generate` option the InfiniGen cache cannot serve, refused before any prefill."""


_BEAM = (
    "beam search (num_beams={num_beams}) reorders the KV cache between beams at every step, which "
    "InfiniGen's offloaded cache does not support: use greedy decoding or sampling (num_beams=1) inside attach"
)
_CROP = (
    "{what} drops the rejected draft tokens by cropping the KV cache, which InfiniGen's offloaded cache "
    "does not support: generate without {option} (greedy decoding or sampling) inside attach"
)
# The generation modes that reorder or copy the cache's rows (assisted decoding, which crops it, apart).
_REFUSED: dict[GenerationMode, str] = {
    GenerationMode.BEAM_SEARCH: _BEAM,
    GenerationMode.BEAM_SAMPLE: _BEAM,
    GenerationMode.GROUP_BEAM_SEARCH: _BEAM,
    GenerationMode.CONSTRAINED_BEAM_SEARCH: _BEAM,
    GenerationMode.CONTRASTIVE_SEARCH: (
        "contrastive search (penalty_alpha={penalty_alpha}, top_k={top_k}) copies and reselects the KV cache's "
        "rows at every step, which InfiniGen's offloaded cache does not support: use greedy decoding or sampling "
        "(no penalty_alpha) inside attach"
    ),
}


def wrap_generate(session, generate):
    """`model.generate` that runs on an InfiniGen cache: a fresh one, or the InfiniGenCache
    handed in as `past_key_values` (a continuation); another cache, or `use_cache=False`
    without one, runs the model as it would without infinigen. Options the cache cannot serve
    (beam search, assisted decoding, attention weights, a context longer than the model's)
    are refused before any prefill. A fresh cache is handed back with the output when the
    caller asked for `return_dict_in_generate` (as transformers hands back its own caches,
    to be continued); it is closed when generate fails, when the session detaches or when
    it is collected. Without a dict it is closed when generate returns."""

    @functools.wraps(generate)
    def generate_with_infinigen(*args, **kwargs):
        cache = cache_in(kwargs)
        if cache is not None and not isinstance(cache, SessionCache):
            return generate(*args, **kwargs)  # the caller's own cache: the model runs as without infinigen
        settings = generation_settings(session.model, args, kwargs)
        if not settings.use_cache:
            if cache is None:
                return generate(*args, **kwargs)  # no cache at all: nothing to offload
            raise UnsupportedGenerationError(
                "use_cache=False with an InfiniGen cache as past_key_values would store the whole sequence "
                "in it again at every step: leave use_cache on, or drop past_key_values"
            )
        refuse(settings, kwargs.get("assistant_model"), _prompt_length(args, kwargs), session.adapter.max_positions)
        if cache is not None:
            if isinstance(cache, InfiniGenCache):
                cache.check_open()
            return generate(*args, **with_cache(session.model, kwargs, cache))
        cache = session.new_cache(**_planned_size(settings, args, kwargs))
        session.remember(cache)
        try:
            out = generate(*args, **with_cache(session.model, kwargs, cache))
        except BaseException:
            session.remember(cache, "the generation that made it failed")
            raise
        if not settings.return_dict_in_generate:
            session.remember(cache, "generate returned without return_dict_in_generate=True")
        return out

    return generate_with_infinigen


def generation_settings(model, args: tuple, kwargs: dict) -> GenerationConfig:
    """The settings `generate` will use: the config handed in (or the model's) with the
    keyword arguments applied, by transformers' own merge."""
    given = kwargs.get("generation_config", next((a for a in args if isinstance(a, GenerationConfig)), None))
    rest = {k: v for k, v in kwargs.items() if k != "generation_config"}
    return model._prepare_generation_config(given, **rest)[0]


def refuse(settings: GenerationConfig, assistant_model, prompt: int | None, limit: int) -> None:
    """Raise, in one sentence naming the alternative, for what the cache cannot serve."""
    mode = settings.get_generation_mode(assistant_model)
    if mode == GenerationMode.ASSISTED_GENERATION:
        if settings.prompt_lookup_num_tokens is not None:
            what, option = "prompt lookup decoding (prompt_lookup_num_tokens=...)", "prompt_lookup_num_tokens"
        else:
            what, option = "assisted decoding (assistant_model=...)", "an assistant model"
        raise UnsupportedGenerationError(_CROP.format(what=what, option=option))
    if mode in _REFUSED:
        raise UnsupportedGenerationError(_REFUSED[mode].format(**settings.to_dict()))
    if settings.output_attentions:
        raise UnsupportedGenerationError(
            "output_attentions=True asks for attention weights, which InfiniGen's attention does not return "
            "(a decode step attends only the rows it fetched): leave it off inside attach, or run the model "
            "outside attach with attn_implementation='eager'"
        )
    if prompt is not None:
        check_generation_length(prompt, settings, limit)


def check_generation_length(prompt: int, settings: GenerationConfig, limit: int) -> None:
    """Refuse a generation that would run past the model's context (`limit` positions) before it
    starts, rather than in the middle of its decode steps, losing what it generated."""
    if prompt > limit:
        raise ContextTooLongError(
            f"{prompt} tokens exceed the model's context of {limit} positions (the prompt alone is too long): "
            "shorten the prompt"
        )
    if settings.max_new_tokens is not None:
        if prompt + settings.max_new_tokens > limit:
            raise ContextTooLongError(
                f"the prompt ({prompt} tokens) + max_new_tokens ({settings.max_new_tokens}) exceed the model's "
                f"context of {limit} positions: shorten the prompt or lower max_new_tokens"
            )
    elif settings.max_length is not None and settings.max_length > limit:
        raise ContextTooLongError(
            f"max_length ({settings.max_length}) exceeds the model's context of {limit} positions: "
            "lower max_length, or give max_new_tokens"
        )


def _planned_size(settings: GenerationConfig, args: tuple, kwargs: dict) -> dict[str, int]:
    """new_cache's `batch` and `max_length` for a plain generate, where the call says them: the
    rows (times num_return_sequences) and the prompt plus max_new_tokens. A cache handed back
    for a continuation (return_dict_in_generate) is not capped at this call's length."""
    out = {}
    for x in (args[0] if args else None, kwargs.get("inputs"), kwargs.get("input_ids"), kwargs.get("inputs_embeds")):
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            out["batch"] = int(x.shape[0]) * (settings.num_return_sequences or 1)
            if settings.max_new_tokens is not None and not settings.return_dict_in_generate:
                out["max_length"] = int(x.shape[1]) + settings.max_new_tokens
            break
    return out


def _prompt_length(args: tuple, kwargs: dict) -> int | None:
    """The positions `generate` starts from (a continuation's history included), if given as a tensor."""
    for x in (args[0] if args else None, kwargs.get("inputs"), kwargs.get("input_ids"), kwargs.get("inputs_embeds")):
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return int(x.shape[1])  # [B, T] ids or [B, T, hidden] embeddings
    return None
