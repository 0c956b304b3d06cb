"""The attach session — the only code that changes a model (`infinigen.attach`, in
`infinigen.api`, calibrates the model if needed and returns one).

A session reads a complete skew artifact (it never calibrates or measures: an artifact for
another configuration comes from the `source` it was given), registers the "infinigen" attention function,
sets it as the model's attention implementation, adds one forward pre-hook per attention module,
folds the skew into the weights of models without RoPE (OPT), wraps `model.generate` so that a
plain call uses a fresh `InfiniGenCache` (see `generate_guard.wrap_generate`: what it refuses before any
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

from infinigen.attention import ATTN_NAME, register_attention
from infinigen.budget import Request, plan
from infinigen.cache import InfiniGenCache, SessionCache
from infinigen.compat import cache_in, check_transformers
from infinigen.config import InfiniGenConfig
from infinigen.generate_guard import wrap_generate
from infinigen.layers import AttendObserver
from infinigen.models import ModelAdapter, get_adapter
from infinigen.select import NotCalibratedError, Selector, make_selector
from infinigen.selfcheck import PROMPT, Reference, passed_before
from infinigen.skew import SkewArtifact, calibration_length
from infinigen.skew.artifact import needs_of

# Makes the complete artifact of a configuration the session does not hold yet (may calibrate).
ArtifactSource = Callable[["Session", InfiniGenConfig], SkewArtifact]

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Session] = weakref.WeakKeyDictionary()


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
        if self.config.spec.calibrated and artifact is None:
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
        model.generate = wrap_generate(self, model.generate)
        self._undo.append(lambda: _restore_attribute(model, "generate", had_own, previous))

    def remember(self, cache: InfiniGenCache, closed_because: str | None = None) -> None:
        """Keep `cache` as `last_cache`: weakly while open (dropping an output handed back with it
        releases its files), or closed now for `closed_because` (it then holds only its counters)."""
        if closed_because is None:
            self._last = weakref.ref(cache)
        else:
            cache.close(closed_because)
            self._last = lambda: cache

    @property
    def last_cache(self) -> InfiniGenCache | None:
        """The cache of the latest plain `generate` call (read its `summary()`); None before one.
        An open one (handed back with the output) is held weakly, so dropping the output frees it."""
        return self._last()

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
        dtype = next(self.model.parameters()).dtype
        config = (config or self.config).in_read_units(self.adapter.head_dim, dtype)  # its unit, made concrete
        request = Request(batch or 1, max_length or self.adapter.max_positions)
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
        config = config.in_read_units(self.adapter.head_dim, next(self.model.parameters()).dtype)
        artifact = self._artifact_for(config) if config.spec.calibrated else None
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


def watch_inputs(modules: list[nn.Module], watcher: Callable[[int, tuple, dict], None]) -> Callable[[], None]:
    """Call `watcher(i, args, kwargs)` with module i's arguments before each of its forwards:
    how a serving engine's model, which this package does not run itself, hands a layer's input to
    InfiniGen (the speculation of layer i+1 reads layer i's). Returns the undo, which removes the
    hooks; the engine owns the model for its whole life, so the integration keeps them."""
    handles = [
        m.register_forward_pre_hook(functools.partial(_forward_args, watcher=watcher, layer=i), with_kwargs=True)
        for i, m in enumerate(modules)
    ]

    def undo() -> None:
        for h in handles:
            h.remove()

    return undo


def _forward_args(module: nn.Module, args: tuple, kwargs: dict, watcher, layer: int) -> None:
    watcher(layer, args, kwargs)


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
