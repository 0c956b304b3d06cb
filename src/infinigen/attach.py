"""The attach session — the only code that changes a model (`infinigen.attach`, in
`infinigen.calibration`, calibrates the model if needed and returns one).

A session reads a complete skew artifact (it never calibrates or measures: an artifact for
another configuration comes from the `source` it was given), registers the "infinigen" attention function,
sets it as the model's attention implementation, adds one forward pre-hook per attention module,
folds the skew into the weights of models without RoPE (OPT), wraps `model.generate` so that a
plain call uses a fresh `InfiniGenCache` (see `_wrap_generate`: what it refuses before any
prefill, and how long the cache lives); during a decode step it sets torch's intra-op threads
to the cache config's `threads` (offloading policies leave a core to the prefetch thread; a
prefill uses every thread). Every change is recorded
with its undo; leaving the block (normally or by an exception), or `session.detach()`, restores
the model exactly: the same parameters bit for bit, the same modules and hooks, attention
implementation and `generate`, and the thread count.

The pre-hook is how the session drives a cache: before layer i's attention it tells the cache
which of the new tokens are real (layer 0), hands layer i its own input and layer i+1 layer i's
input with layer i+1's rotary embedding (so that layer i+1's transfer is issued while layer i
computes), and passes layer i's
cache object to the attention function. State lives in the cache, never on the model.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from infinigen.attention import ATTN_NAME, register_attention
from infinigen.budget import Request, plan
from infinigen.cache import ContextTooLongError, InfiniGenCache, SessionCache
from infinigen.compat import cache_in, check_transformers, with_cache
from infinigen.config import InfiniGenConfig
from infinigen.errors import InfiniGenError
from infinigen.layers import AttendObserver
from infinigen.models import ModelAdapter, get_adapter
from infinigen.select import NotCalibratedError, Selector, make_selector
from infinigen.selfcheck import PROMPT, Reference, passed_before
from infinigen.skew import SkewArtifact, calibration_length
from infinigen.skew.artifact import needs_of

# Makes the complete artifact of a configuration the session does not hold yet (may calibrate).
ArtifactSource = Callable[["Session", InfiniGenConfig], SkewArtifact]

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Session] = weakref.WeakKeyDictionary()


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


class Session:
    """One model attached to InfiniGen (see the module docstring). Make caches with `new_cache`."""

    def __init__(
        self,
        model: nn.Module,
        config: InfiniGenConfig | None = None,
        *,
        artifact: SkewArtifact | None = None,
        tokenizer=None,
        source: ArtifactSource | None = None,
        observer_for: Callable[[InfiniGenConfig], AttendObserver | None] | None = None,
        check: bool = True,
    ) -> None:
        """artifact: the complete skew artifact of `config` (policy infinigen), verified by whoever
        made it; source: what makes the artifact of another configuration (`calibration.Calibrator`);
        without one, such a configuration is refused. observer_for: what watches a new cache's
        attention for a config (recall, `measure_recall`: measured by the evaluation, above).
        check: decode a few positions through a full-fetch cache and compare them with the model's
        own before handing the session out (`infinigen.selfcheck`; refuses with SelfCheckError), unless
        this model, with the same dtype and device, passed it before in this process."""
        if model in _ATTACHED:
            raise RuntimeError(
                "this model is already attached to an infinigen session: leave that `with` block "
                "(or call its detach()) before attaching again"
            )
        self.model = model
        self.config = config or InfiniGenConfig()
        self.adapter: ModelAdapter = get_adapter(model)  # raises for unsupported families
        self.tokenizer = tokenizer
        self._last: Callable[[], InfiniGenCache | None] = _nothing  # see `last_cache`
        self._caches: weakref.WeakSet[InfiniGenCache] = weakref.WeakSet()  # closed at detach
        self._source = source
        self._observer_for = observer_for
        self._artifacts: dict[tuple, SkewArtifact] = {}
        self._undo: list[Callable[[], None]] = []
        self.folded = False
        self.config.check_layers(self.adapter.num_layers)
        self._threads = torch.get_num_threads()  # restored on detach; prefills always use them
        if self.config.spec.selector == "infinigen" and artifact is None:
            raise ValueError("a session of the infinigen policy needs its skew artifact: use `infinigen.attach`")
        self.artifact = artifact
        if artifact is not None:
            self.hold(self.config, artifact)
        check_transformers()
        self.check_distance: float | None = None  # the self-check's relative distance of logits, when run
        reference = Reference(model) if check and not passed_before(model) else None
        try:
            self._change_model()
            _ATTACHED[model] = self
            if reference is not None:
                self.check_distance = reference.verify(
                    model, lambda cfg: self.new_cache(cfg, max_length=PROMPT + 1, batch=1), self.config
                )
                torch.set_num_threads(self._threads)  # the check's decode step set the decode threads
        except BaseException:
            self.detach()
            raise

    # ------------------------------------------------------------------ changing the model
    def _change_model(self) -> None:
        model = self.model
        self._undo.append(functools.partial(torch.set_num_threads, self._threads))
        register_attention()
        original_attn = model.config._attn_implementation
        model.set_attn_implementation(ATTN_NAME)
        self._undo.append(lambda: model.set_attn_implementation(original_attn))
        for i, module in enumerate(self.adapter.attention_modules()):
            handle = module.register_forward_pre_hook(functools.partial(self._pre_hook, layer=i), with_kwargs=True)
            self._undo.append(handle.remove)
        art = self.artifact
        if art is not None and art.skewed and not self.adapter.has_rope:
            originals = self.adapter.fold_skew({i: a for i, a in art.skews.items() if a is not None})
            self.folded = True
            self._undo.append(functools.partial(_restore_parameters, originals))
        had_own = "generate" in model.__dict__
        previous = model.__dict__.get("generate")
        model.generate = self._wrap_generate(model.generate)
        self._undo.append(lambda: _restore_attribute(model, "generate", had_own, previous))

    def _wrap_generate(self, generate):
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
            settings = self._settings(args, kwargs)
            if not settings.use_cache:
                if cache is None:
                    return generate(*args, **kwargs)  # no cache at all: nothing to offload
                raise UnsupportedGenerationError(
                    "use_cache=False with an InfiniGen cache as past_key_values would store the whole sequence "
                    "in it again at every step: leave use_cache on, or drop past_key_values"
                )
            self._refuse(settings, kwargs.get("assistant_model"), _prompt_length(args, kwargs))
            if cache is not None:
                if isinstance(cache, InfiniGenCache):
                    cache.check_open()
                return generate(*args, **with_cache(self.model, kwargs, cache))
            cache = self.new_cache(**_planned_size(settings, args, kwargs))
            self._last = weakref.ref(cache)  # dropping an output handed back releases its files
            try:
                out = generate(*args, **with_cache(self.model, kwargs, cache))
            except BaseException:
                self._close(cache, "the generation that made it failed")
                raise
            if not settings.return_dict_in_generate:
                self._close(cache, "generate returned without return_dict_in_generate=True")
            return out

        return generate_with_infinigen

    def _close(self, cache: InfiniGenCache, reason: str) -> None:
        """Close `cache` and keep it as `last_cache` (a closed cache holds only its counters)."""
        cache.close(reason)
        self._last = lambda: cache

    @property
    def last_cache(self) -> InfiniGenCache | None:
        """The cache of the latest plain `generate` call (read its `summary()`); None before one.
        An open one (handed back with the output) is held weakly, so dropping the output frees it."""
        return self._last()

    def _settings(self, args: tuple, kwargs: dict) -> GenerationConfig:
        """The settings `generate` will use: the config handed in (or the model's) with the
        keyword arguments applied, by transformers' own merge."""
        given = kwargs.get("generation_config", next((a for a in args if isinstance(a, GenerationConfig)), None))
        rest = {k: v for k, v in kwargs.items() if k != "generation_config"}
        return self.model._prepare_generation_config(given, **rest)[0]

    def _refuse(self, settings: GenerationConfig, assistant_model, prompt: int | None) -> None:
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
            check_generation_length(prompt, settings, self.adapter.max_positions)

    def _pre_hook(self, module: nn.Module, args, kwargs, layer: int):
        cache = cache_in(kwargs)
        if not isinstance(cache, SessionCache):
            return None  # a plain cache (or none): the model runs as it would without infinigen
        x = kwargs.get("hidden_states", args[0] if args else None)
        pe = kwargs.get("position_embeddings")
        if layer == 0:
            cache.begin_forward(new_token_validity(kwargs.get("attention_mask"), x, cache.get_seq_length()))
            self._set_threads(cache, x.shape[1])
        cache.layers[layer].own_input(x, pe)
        if layer + 1 < len(cache.layers):
            # The next layer's query must be rotated as that layer rotates it (Gemma-3's global
            # layers use another RoPE than the local ones before them): the adapter says how.
            pe_next = self.adapter.rope_for(layer + 1, layer, pe, kwargs.get("position_ids"), x)
            cache.layers[layer + 1].previous_input(x, pe_next)
        return args, {**kwargs, "infinigen_layer": cache.layers[layer]}

    def _set_threads(self, cache: SessionCache, new_tokens: int) -> None:
        """A decode step runs with its config's compute threads (an offloading policy leaves a
        core to its prefetch thread); anything else with the threads torch had at attach."""
        config = getattr(cache, "config", None)
        want = config.threads(self._threads) if new_tokens == 1 and config is not None else self._threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def detach(self) -> None:
        """Close the caches this session made that are still open, then undo every change,
        newest first (idempotent)."""
        for cache in list(self._caches):
            cache.close("its attach session was detached")
        while self._undo:
            self._undo.pop()()
        self.folded = False
        if _ATTACHED.get(self.model) is self:
            del _ATTACHED[self.model]

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    @property
    def attached(self) -> bool:
        return _ATTACHED.get(self.model) is self

    # ------------------------------------------------------------------ caches
    def new_cache(
        self,
        config: InfiniGenConfig | None = None,
        *,
        max_length: int | None = None,
        batch: int | None = None,
        trace: bool = False,
    ) -> InfiniGenCache:
        """A fresh cache for one generation (`config` defaults to the session's).

        max_length: the positions the generation will reach (prompt + new tokens), if known;
        batch: its rows, if known (both size the plan of what stays with the compute, and a
        `compute_memory` budget is checked against them here, before any KV exists: default the
        model's context and 1); trace: keep a record of every transfer (`cache.trace`)."""
        if not self.attached:
            raise RuntimeError("this session is detached: attach the model again to make a cache")
        config = config or self.config
        request = Request(batch or 1, max_length or self.adapter.max_positions)
        dtype = next(self.model.parameters()).dtype
        planned = plan(config, self.adapter, self.selector_for, request, dtype)  # refuses what cannot fit
        config = planned.config
        observer = self._observer_for(config) if self._observer_for is not None else None
        cache = InfiniGenCache(
            config, self.adapter, planned.selector, max_length=max_length, trace=trace, observer=observer,
            plan=planned,
        )  # fmt: skip
        self._caches.add(cache)
        return cache

    def selector_for(self, config: InfiniGenConfig) -> Selector | None:
        """The selector of `config` in this session (None for a policy that reads every row)."""
        config.check_layers(self.adapter.num_layers)
        artifact = self._artifact_for(config) if config.spec.selector == "infinigen" else None
        return make_selector(config, self.adapter, artifact, folded=self.folded)

    def hold(self, config: InfiniGenConfig, artifact: SkewArtifact) -> None:
        """Serve `config`'s skew settings from `artifact` from now on."""
        self._artifacts[self._key(config)] = artifact

    def _key(self, config: InfiniGenConfig) -> tuple:
        return (*config.skew_key()[:2], calibration_length(config.calibration_tokens, self.adapter))

    def _artifact_for(self, config: InfiniGenConfig) -> SkewArtifact:
        key = self._key(config)
        art = self._artifacts.get(key)
        if art is not None:
            missing = art.lacks(**needs_of(config))
            if not missing:
                return art
            if self._source is None or self.folded:
                raise ValueError(f"this session's skew artifact {missing}: calibrate it again (`infinigen skew`)")
            del self._artifacts[key]  # an older artifact without that table: its source remakes it
        if self.folded:  # the weights carry one artifact's skew: no other can be used with them
            raise ValueError(
                f"this session uses the skew folded into its weights (partial_ratio, skew, calibration tokens = "
                f"{next(iter(self._artifacts))}); the configuration asks for {key}: attach again with that configuration"
            )
        if self._source is None:
            raise NotCalibratedError(
                f"this session holds no skew artifact for (partial_ratio, skew, calibration tokens) = {key}: "
                "attach with `infinigen.attach`, which calibrates on first use"
            )
        return self._source(self, config)


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


def _nothing() -> None:
    return None


def new_token_validity(attention_mask: torch.Tensor | None, x: torch.Tensor, past: int) -> torch.Tensor:
    """[B, q] which of a forward's q new tokens are real, read from the 4D attention mask the
    model built: a real token sees itself, padding is seen by no one. Each new token's own
    column is read (its diagonal): the mask's last q columns are the new tokens whether the
    mask covers the whole context or, for a sliding-window layer, only its window, and a
    token always lies in its own window. All real without a mask."""
    b, q = x.shape[0], x.shape[1]
    if attention_mask is None or attention_mask.dim() != 4:
        return torch.ones(b, q, dtype=torch.bool, device=x.device)
    if attention_mask.shape[2] == q and attention_mask.shape[3] >= q:
        own = torch.diagonal(attention_mask[:, 0, :, attention_mask.shape[3] - q :], dim1=-2, dim2=-1)
    else:  # rows broadcast: the last one sees every real position of the context
        own = attention_mask[:, 0, -1, past : past + q]
    valid = own if own.dtype == torch.bool else own > torch.finfo(own.dtype).min / 2
    return valid.expand(b, -1) if valid.shape[0] != b else valid


def _restore_parameters(originals: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    with torch.no_grad():
        for param, value in originals:
            param.copy_(value)


def _restore_attribute(obj, name: str, had_own: bool, previous) -> None:
    if had_own:
        setattr(obj, name, previous)
    else:
        obj.__dict__.pop(name, None)
