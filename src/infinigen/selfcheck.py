"""A cheap check, at attach, that the model's attention really runs through the session.

infinigen sits inside a model's attention through transformers' interfaces (the cache keyword,
the attention registry, the Cache layer API). A release that changes one of them does not fail:
the model quietly attends what the cache handed back without the session, and the text is
wrong. So before a session is handed out, a few positions are decoded through a full-fetch
cache (16-bit stored rows, read in chunks: the paths a wrong layout breaks) and compared with
the model's own output, computed before the session changed anything. A mismatch, or a layer
whose attention did not go through its cache layer, refuses the session in one sentence.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import transformers
from torch import nn

from infinigen.compat import cache_kwargs, tested_range
from infinigen.config import InfiniGenConfig
from infinigen.errors import InfiniGenError

PROMPT = 8  # positions prefilled; one more is decoded and compared
CHUNK = 3  # the decode step reads its rows in chunks of this many positions (several chunks merged)
# The largest relative distance between the logits through the cache and the model's own that
# passes: 16-bit stored rows move them by about 1e-3 (measured in tests/test_selfcheck.py); an
# attention that misses its rows moves them by tens of percent.
TOLERANCE = 0.02


class SelfCheckError(InfiniGenError, RuntimeError):
    """The model's attention does not run through the session as it must: refused, not wrong."""


def check_key(model: nn.Module) -> tuple:
    """What a passed check vouches for: this model (by identity), its dtype, device and attention
    implementation, under this transformers. Attaching the same model again skips the check."""
    param = next(model.parameters())
    return (id(model), param.dtype, param.device, model.config._attn_implementation, transformers.__version__)


_PASSED: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def passed_before(model: nn.Module) -> bool:
    """Whether this model, as it is now, already passed the check in this process."""
    return _PASSED.get(model) == check_key(model)


class Reference:
    """The model's own last-position logits on a few fixed tokens, taken before attach."""

    def __init__(self, model: nn.Module) -> None:
        vocab = model.get_input_embeddings().weight
        n = PROMPT + 1
        # Fixed, spread over the vocabulary, none repeated: every position has its own key.
        self.ids = ((torch.arange(n) * 7919 + 13) % vocab.shape[0]).to(vocab.device)[None]
        self.key = check_key(model)
        with _evaluating(model), torch.no_grad():
            self.logits = model(input_ids=self.ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()

    def verify(
        self, model: nn.Module, new_cache: Callable[[InfiniGenConfig], object], config: InfiniGenConfig
    ) -> float:
        """Decode the last token through a full-fetch cache made by `new_cache` and compare;
        returns the relative distance of the logits (raises SelfCheckError above TOLERANCE)."""
        check = config.replace(
            policy="full", tier="ram", kv_dtype="float16", fetch_chunk=CHUNK, compute_memory=None,
            host_capacity=None, kv_dir=None,
        )  # fmt: skip
        cache = new_cache(check)
        attended = _count_attends(cache.layers)
        try:
            with _evaluating(model), torch.no_grad():
                model(input_ids=self.ids[:, :PROMPT], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
                before = attended.copy()
                out = model(input_ids=self.ids[:, PROMPT:], **cache_kwargs(model, cache), use_cache=True)
        finally:
            cache.close("the attach self-check ended")
        missed = [i for i, (a, b) in enumerate(zip(before, attended, strict=True)) if b == a]
        got = out.logits[0, -1].float()
        distance = float((got - self.logits).norm() / (self.logits - self.logits.mean()).norm().clamp_min(1e-12))
        if missed or not distance <= TOLERANCE:
            what = (
                f"the attention of layers {_spans(missed)} did not go through the cache"
                if missed
                else f"a decode step through the cache gave logits {distance:.0%} away from the model's own"
            )
            raise SelfCheckError(
                f"infinigen's attach self-check failed on transformers {transformers.__version__} "
                f"(tested: {tested_range() or 'unknown'}): {what}, so generation would be silently wrong; "
                "install a tested transformers release"
            )
        _PASSED[model] = self.key
        return distance


def _count_attends(layers) -> list[int]:
    """Count each cache layer's `attend` calls (on the instances: this cache is the check's own)."""
    counts = [0] * len(layers)

    def counted(i: int, attend):
        @functools.wraps(attend)
        def wrapper(*args, **kwargs):
            counts[i] += 1
            return attend(*args, **kwargs)

        return wrapper

    for i, layer in enumerate(layers):
        layer.attend = counted(i, layer.attend)
    return counts


class _evaluating:
    """The model in eval mode (no dropout) for the block, its mode restored after."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.training = model, model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc) -> None:
        self.model.train(self.training)


def _spans(layers: list[int]) -> str:
    if len(layers) > 4:
        return f"{layers[0]}..{layers[-1]} ({len(layers)} of them)"
    return ", ".join(map(str, layers))
