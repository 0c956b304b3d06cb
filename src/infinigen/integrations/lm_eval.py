"""lm-evaluation-harness (0.4.x) as a client of InfiniGen's cache: the model type ``infinigen``.

    python -m infinigen.integrations.lm_eval --model infinigen \\
        --model_args pretrained=smollm2,policy=infinigen,budget=0.1,tier=disk --tasks ...

lm-eval 0.4.13 knows only the model types registered in its own registry: it reads no plugin
entry points. Importing this module registers ``infinigen`` (lazily, by name, so that running
the module as a script and importing it agree); ``python -m infinigen.integrations.lm_eval``
registers it and runs lm-eval's own command line, every argument unchanged.

`InfiniGenLM` is lm-eval's `HFLM` with two changes:
  * the model comes from infinigen's loader (`infinigen.loading.load_model`: ``smollm2``,
    ``gemma3-270m``, a folder or a .gguf, offline) and is attached to one InfiniGen session for
    the evaluator's lifetime;
  * every request runs through a fresh cache of that session.
    ``generate_until``: `model.generate` with the cache (dense prefill, then each decode step
    reads what the policy selects), exactly as ``infinigen generate`` decodes.
    ``loglikelihood`` (and ``loglikelihood_rolling``, which lm-eval reduces to it): a plain
    forward would be dense attention, whatever the policy. Instead the context is prefilled
    (dense, as every policy prefills) and the continuation is teacher-forced one decode step at a
    time through the cache, so that each continuation token after the first is scored as greedy
    decoding under the policy would see it. The first continuation token is predicted by the
    prefill, as the first generated token is: a one-token continuation (most multiple-choice
    tasks) scores the same under every policy.

Every `InfiniGenConfig` field is a model argument, parsed by the config's own rules
(`infinigen.cli_settings.parse_setting`); the defaults are those of infinigen's commands
(`RUN_DEFAULTS`: the KV stored in 16 bits). What the caches moved is summed per request type
(`CacheTotals`) and reported in the results' ``config.infinigen`` (lm-eval's ``--output_path``).
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.registry import model_registry
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import get_dtype
from tqdm.auto import tqdm

from infinigen.api import attach
from infinigen.cli_settings import RUN_DEFAULTS, parse_setting
from infinigen.compat import cache_kwargs
from infinigen.config import InfiniGenConfig
from infinigen.loading import DEFAULT_MODEL, load_model, resolve_model_folder
from infinigen.prefill import PREFILL_CHUNK, chunked_prefill

MODEL_TYPE = "infinigen"
# The offline tasks of this package (`--include_path`): infinigen_passkey, infinigen_needle
# (loglikelihood) and infinigen_passkey_gen (generate_until); tag infinigen_retrieval.
TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")
# HFLM's own arguments pass through (batch_size, max_length, tokenizer, ...); loading ones are unused.
_HFLM_ARGS = frozenset(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs"}

log = logging.getLogger(__name__)


@dataclass
class CacheTotals:
    """What the caches of one request type moved over a run, summed from each `cache.summary()`."""

    caches: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    bytes_fetched: int = 0
    rows_fetched: int = 0
    _fraction_sum: float = 0.0  # Σ fetched_fraction × decode tokens, over caches that fetched
    _fraction_tokens: int = 0

    def add(self, summary: dict[str, Any]) -> None:
        tokens = summary["decode_steps"] * max(summary["batch"], 1)
        self.caches += 1
        self.prefill_tokens += summary["prefill_tokens"] * max(summary["batch"], 1)
        self.decode_tokens += tokens
        self.bytes_fetched += summary["bytes_fetched"]
        self.rows_fetched += summary["rows_fetched"]
        if summary["fetched_fraction"] is not None and tokens:
            self._fraction_sum += summary["fetched_fraction"] * tokens
            self._fraction_tokens += tokens

    def as_dict(self) -> dict[str, Any]:
        """fetched_fraction: the mean over decode tokens (None: nothing is offloaded, dense)."""
        return {
            "caches": self.caches,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "fetched_fraction": self._fraction_sum / self._fraction_tokens if self._fraction_tokens else None,
            "bytes_fetched": self.bytes_fetched,
            "bytes_fetched_per_token": self.bytes_fetched / self.decode_tokens if self.decode_tokens else 0.0,
            "rows_fetched": self.rows_fetched,
        }


def _as_text(value: Any) -> str:
    """A model argument as the text a user typed: lm-eval has already turned "0.1" into 0.1,
    "true" into True, "none" into None and "{2:1}" into a dict."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in value.items())
    return str(value)


def config_from_args(args: dict[str, Any]) -> InfiniGenConfig:
    """The config of the model arguments that are `InfiniGenConfig` settings, over the commands'
    defaults; each is parsed and checked by the config itself (an unknown name is refused there)."""
    given = {name: parse_setting(name, _as_text(value)) for name, value in args.items()}
    return InfiniGenConfig(**{**RUN_DEFAULTS, **given})


class InfiniGenLM(HFLM):
    """lm-eval's HFLM whose every generation and loglikelihood runs through an InfiniGen cache
    (see the module docstring). Model arguments: `pretrained` (an infinigen model name, folder or
    .gguf; default smollm2), `dtype` (default float32), `device`, HFLM's own arguments, and every
    `InfiniGenConfig` setting (policy, budget, tier, kv_dtype, ...)."""

    def __init__(
        self,
        pretrained: str = DEFAULT_MODEL,
        dtype: str | torch.dtype = "float32",
        device: str | None = None,
        progress: bool = True,
        **kwargs: Any,
    ) -> None:
        hf_args = {k: v for k, v in kwargs.items() if k in _HFLM_ARGS}
        self.infinigen_config = config_from_args({k: v for k, v in kwargs.items() if k not in _HFLM_ARGS})
        torch_dtype = get_dtype(dtype)
        model, tokenizer = load_model(
            pretrained, dtype=torch.float32 if torch_dtype == "auto" else torch_dtype, progress=progress
        )
        if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
            device = "cuda" if torch.cuda.is_available() else "cpu"  # as HFLM does without the device asked for
        model.to(device)
        hf_args.setdefault("tokenizer", tokenizer)
        super().__init__(pretrained=model, **hf_args)
        self.model_name = pretrained
        self.model_folder = str(resolve_model_folder(pretrained, progress=False))
        self.session = attach(model, self.infinigen_config, tokenizer=self.tokenizer, progress=progress)
        self.totals = {"generate_until": CacheTotals(), "loglikelihood": CacheTotals()}

    def close(self) -> None:
        """Detach the session: the model is as loaded again (lm-eval itself never calls this)."""
        self.session.detach()

    # ------------------------------------------------------------------ generation
    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """HFLM's generation, with a fresh cache of the session sized to this batch's generation."""
        with self.session.new_cache(max_length=max_length) as cache:
            mask = generation_kwargs.get("attention_mask")
            if context.shape[1] > PREFILL_CHUNK and (mask is None or bool(mask.all())):
                # A long prompt without padding is prefilled in chunks; generate goes on from the cache.
                chunked_prefill(self.model, context[:, :-1], cache, logits_to_keep=1)
            out = super()._model_generate(
                context, max_length, stop, **cache_kwargs(self.model, cache), **generation_kwargs
            )
            self.totals["generate_until"].add(cache.summary())
        return out

    # ------------------------------------------------------------------ loglikelihood
    @torch.no_grad()
    def forced_logits(self, prompt: list[int], forced: list[int]) -> torch.Tensor:
        """[1 + len(forced), vocab] logits: after the prompt (its dense prefill), then after each
        forced token, one decode step each through a fresh cache of the session."""
        with self.session.new_cache(max_length=len(prompt) + len(forced)) as cache:
            out = chunked_prefill(self.model, torch.tensor([prompt], device=self.device), cache, logits_to_keep=1)
            rows = [out.logits[0, -1]]
            for token in forced:
                step = torch.tensor([[token]], device=self.device)
                rows.append(self.model(input_ids=step, **cache_kwargs(self.model, cache), use_cache=True).logits[0, -1])
            self.totals["loglikelihood"].add(cache.summary())
        return torch.stack(rows)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(log p(continuation | context), greedy) per request, in order, one request at a time:
        the context prefilled, the continuation decoded through the cache (the module docstring).
        The window is HFLM's: context + continuation cut from the left to max_length + 1 tokens."""
        results = []
        for key, context, continuation in tqdm(
            requests, disable=disable_tqdm or self.rank != 0, desc="loglikelihood through the InfiniGen cache"
        ):
            assert context and continuation and len(continuation) <= self.max_length
            window = (context + continuation)[-(self.max_length + 1) :][:-1]
            split = len(window) - len(continuation) + 1  # the prompt's last token predicts continuation[0]
            logits = self.forced_logits(window[:split], window[split:])
            logprobs = F.log_softmax(logits.float(), dim=-1)
            target = torch.tensor(continuation, device=logprobs.device)
            answer = (float(logprobs.gather(1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all()))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        return results

    # ------------------------------------------------------------------ reporting
    def get_model_info(self) -> dict[str, Any]:
        """HFLM's model info without its hub look-up (the model is local), plus the InfiniGen
        settings and what the caches moved, per request type (results' ``config.infinigen``)."""
        totals = {kind: t.as_dict() for kind, t in self.totals.items() if t.caches}
        for kind, t in totals.items():
            log.info("infinigen cache (%s, policy %s): %s", kind, self.infinigen_config.policy, t)
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "infinigen": {
                "pretrained": self.model_name,
                "folder": self.model_folder,
                "config": self.infinigen_config.to_dict(),
                "cache": totals,
            },
        }


def register() -> None:
    """Register the model type ``infinigen`` with lm-eval (idempotent): by name, so that the class
    is imported from this module however the module itself was run."""
    model_registry.register(MODEL_TYPE, target=f"{__spec__.name if __spec__ else __name__}:InfiniGenLM")


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line (``lm_eval ...``) with the model type ``infinigen`` registered."""
    from lm_eval.__main__ import cli_evaluate

    register()
    sys.argv[:] = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


register()

if __name__ == "__main__":
    main()
