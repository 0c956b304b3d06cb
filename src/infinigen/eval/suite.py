"""`infinigen eval`: every policy at matched budgets on real text and retrieval prompts.

Suites (each row of the output is one policy at one budget on one input):
  ppl          perplexity, top-1 agreement and KL vs dense, attention recall, on windows of real
               text (Paul Graham essays, SQuAD paragraphs): the last `score_tokens` of each window
               are teacher-forced through the policy after a dense prefill of the rest;
  passkey      a 5-digit key hidden in filler at three depths, 1K-8K tokens;
  needle       a sentence hidden in the essays, same lengths and depths;
  sensitivity  InfiniGen alone, threshold mode: alpha, partial ratio, skew on/off;
  variants     InfiniGen at one matched budget: aggregation, partial ratio, dense layers, skew;
  ruler        RULER's synthetic tasks (needles, variable tracking, word extraction, QA) from the
               generators of `nvidia-long-context-eval`, greedy outputs scored by RULER's
               string match (`infinigen.eval.ruler`).

Retrieval is scored exactly as greedy decoding would score it, by teacher forcing: greedy
emits the answer iff the argmax after the prompt and each answer prefix is the next answer
token. The first answer token comes from the (dense) prefill, as in generation.
Everything runs through `Evaluator`, which `tests/test_forced.py` proves equal to the
step-by-step decode path.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from infinigen.cli_settings import RUN_DEFAULTS
from infinigen.compat import cache_kwargs
from infinigen.config import POLICIES, InfiniGenConfig
from infinigen.eval.evaluator import Evaluator, ForcedResult, Prefix
from infinigen.eval.report import DEFAULT_VARIANT
from infinigen.measure.metrics import kl_divergence, top1_agreement
from infinigen.storage import row_bytes


@dataclass
class EvalSettings:
    policies: tuple[str, ...] = tuple(POLICIES)
    budgets: tuple[float, ...] = (0.05, 0.1, 0.2)
    datasets: tuple[str, ...] = ("essays", "squad")
    contexts: tuple[int, ...] = (2048, 4096)
    score_tokens: int = 512
    windows: int = 1
    retrieval_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    alphas: tuple[float, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    ratios: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
    sensitivity_context: int = 2048
    variant_budget: float = 0.1
    variants: tuple[tuple[str, dict[str, Any]], ...] | None = None  # None: the built-in list
    ruler_tasks: tuple[str, ...] | None = None  # None: every task of infinigen.eval.ruler.TASKS
    ruler_lengths: tuple[int, ...] = (4096, 8192)
    ruler_samples: int = 4
    kv_dtype: str = RUN_DEFAULTS["kv_dtype"]  # stored as the commands store it
    base: dict[str, Any] = dataclasses.field(default_factory=dict)  # extra InfiniGenConfig fields


def policy_configs(settings: EvalSettings) -> list[tuple[str, float | None, InfiniGenConfig]]:
    """(policy, budget, config) for every run of a matched-budget comparison. dense, full and
    int4 have no budget (one run each); every selecting policy keeps exactly the budget —
    InfiniGen as the top-budget positions of its speculated scores (alpha = inf; the alpha
    threshold, which sets its own fraction, is studied in the sensitivity suite)."""
    out = []
    for p in settings.policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}")
        common = dict(settings.base, policy=p, kv_dtype=settings.kv_dtype)
        if POLICIES[p].selector is None:
            out.append((p, None, InfiniGenConfig(**common)))
        elif p == "infinigen":
            for b in settings.budgets:
                out.append((p, b, InfiniGenConfig(alpha=math.inf, budget=b, **common)))
        else:
            for b in settings.budgets:
                out.append((p, b, InfiniGenConfig(budget=b, **common)))
    return out


def full_fetch_bytes_per_token(model_adapter, context: float, kv_dtype: str) -> float:
    """What fetching every offloaded layer's whole KV costs per token at a mean `context` (the
    bytes axis); local (sliding-window) layers are never offloaded."""
    per_row = row_bytes("native", model_adapter.head_dim, InfiniGenConfig(kv_dtype=kv_dtype).storage_dtype())
    return len(model_adapter.global_layers) * model_adapter.num_kv_heads * context * per_row


def _row(result: ForcedResult, ref: torch.Tensor | None, targets: torch.Tensor | None, full_bytes: float) -> dict:
    logits = result.logits[0]
    row: dict[str, Any] = {
        "fetched_fraction": result.fetched_fraction if POLICIES[result.policy].selector is not None else 1.0,
        "bytes_per_token": result.bytes_per_token(),
        "bytes_fraction": result.bytes_per_token() / full_bytes if full_bytes else None,
        "recall": result.recall,
        "per_layer_fraction": {str(k): v for k, v in result.per_layer_fraction.items()},
        "per_layer_correction": {str(k): v for k, v in result.per_layer_correction.items()},
        "per_layer_recall": {str(k): v for k, v in result.per_layer_recall.items()},
        "per_head_recall": {str(k): v for k, v in result.per_head_recall.items()},
    }
    if POLICIES[result.policy].placement == "compute":
        row["bytes_fraction"] = None
        row["fetched_fraction"] = None
    if targets is not None:
        n = targets.shape[0]
        nll = torch.nn.functional.cross_entropy(logits[:n], targets, reduction="mean").item()
        row["nll"] = nll
        row["ppl"] = math.exp(nll)
    if ref is not None:
        row["top1_agreement"] = top1_agreement(logits, ref)
        row["kl"] = kl_divergence(ref, logits)
    return row


class EvalRunner:
    def __init__(self, model, tokenizer, settings: EvalSettings, progress: bool = True) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.ev = Evaluator(model, tokenizer=tokenizer, progress=progress)
        self.progress = progress

    # ---------------------------------------------------------------- text quality
    def ppl_window(self, ids: torch.Tensor, runs, measure_recall: bool = True) -> list[dict]:
        """One window: dense prefill of ids[:-S-1], then S forced tokens per config."""
        s = self.settings.score_tokens
        t0 = ids.shape[0] - s - 1
        chunk, targets = ids[t0 : t0 + s][None], ids[t0 + 1 : t0 + s + 1]
        prefix = self.ev.prefill(ids[:t0][None])
        full_bytes = full_fetch_bytes_per_token(self.ev.adapter, t0 + (s - 1) / 2, self.settings.kv_dtype)
        dense = self.ev.run(prefix, chunk, InfiniGenConfig(policy="dense"))
        ref = dense.logits[0]
        rows = []
        for label, budget, cfg in runs:
            start = time.perf_counter()
            if cfg.spec.placement == "compute":
                res = dense  # the reference itself
            else:
                res = self.ev.run(prefix, chunk, cfg, measure_recall=measure_recall)
            row = {"policy": label, "budget": budget, **_row(res, ref, targets, full_bytes)}
            row["seconds"] = time.perf_counter() - start
            row["config"] = cfg.to_dict()
            rows.append(row)
        return rows

    def ppl_suite(self, bar=None) -> list[dict]:
        from infinigen.eval.datasets import text_windows

        st = self.settings
        runs = policy_configs(st)
        out = []
        for ds in st.datasets:
            for ctx in st.contexts:
                for w, win in enumerate(text_windows(self.tokenizer, ds, ctx, st.windows)):
                    ids = torch.tensor(win)
                    for row in self.ppl_window(ids, runs):
                        out.append({"suite": "ppl", "dataset": ds, "context": ctx, "window": w, **row})
                    if bar is not None:
                        bar.update(1)
        return out

    # ---------------------------------------------------------------- retrieval
    def retrieval_suite(self, task: str, bar=None) -> list[dict]:
        from infinigen.eval.retrieval import answer_correct, retrieval_cases

        st = self.settings
        runs = policy_configs(st)
        out = []
        for case in retrieval_cases(self.tokenizer, task, st.retrieval_lengths, st.depths):
            prompt = torch.tensor(case.prompt_ids)[None]
            answer = torch.tensor(case.answer_ids)
            prefix = self.ev.prefill(prompt)
            first = int(prefix.last_logits[0].argmax())
            # the forced answer tokens see contexts length .. length + n - 2: their mean
            full_bytes = full_fetch_bytes_per_token(
                self.ev.adapter, case.length + (answer.shape[0] - 2) / 2, st.kv_dtype
            )
            for label, budget, cfg in runs:
                if answer.shape[0] > 1:
                    res = self.ev.run(prefix, answer[:-1][None], cfg)
                    forced = [first, *res.logits[0].argmax(-1).tolist()]
                    extra = _row(res, None, None, full_bytes)
                else:
                    forced, extra = [first], {}
                out.append(
                    {
                        "suite": task,
                        "policy": label,
                        "budget": budget,
                        "length": case.length,
                        "depth": case.depth,
                        "correct": answer_correct(forced, case.answer_ids),
                        "answer": case.answer,
                        "output": self.tokenizer.decode(forced),
                        **{k: extra.get(k) for k in ("fetched_fraction", "bytes_fraction")},
                    }
                )
            if bar is not None:
                bar.update(1)
        return out

    # ---------------------------------------------------------------- RULER
    @torch.no_grad()
    def dense_greedy(self, prefix: Prefix, n: int) -> list[int]:
        """n greedy tokens of the plain model after the prefix, decoded on a copy of its cache (a
        sliding-window layer cannot be cropped back once its window is full)."""
        cache = copy.deepcopy(prefix.cache)
        tokens = [int(prefix.last_logits[0].argmax())]
        for _ in range(n - 1):
            out = self.model(input_ids=torch.tensor([[tokens[-1]]]), **cache_kwargs(self.model, cache), use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens

    def policy_greedy(
        self, prefix: Prefix, guess: list[int], config: InfiniGenConfig, stop: set[int], rounds: int = 8
    ) -> tuple[list[int], ForcedResult, bool]:
        """Greedy decoding under `config`, exactly, by teacher forcing (Jacobi fixed point): force
        the guess, keep it up to the first token the policy would not have emitted, continue
        with the policy's own predictions, repeat. Each round confirms at least one more token,
        and a guess the policy agrees with (the dense output, mostly) takes one round. Returns
        (tokens confirmed, the last forced run, whether all n were confirmed within `rounds`)."""
        n = len(guess)
        seq = list(guess)
        seq[0] = int(prefix.last_logits[0].argmax())  # the prefill's token: dense for every policy
        res = None
        for _ in range(rounds):
            res = self.ev.run(prefix, torch.tensor(seq[: n - 1])[None], config)
            pred = res.logits[0].argmax(-1).tolist()  # pred[j]: the token after seq[: j + 1]
            end = next((j for j, t in enumerate(seq) if t in stop), n - 1)
            miss = next((j for j in range(min(end, n - 1)) if pred[j] != seq[j + 1]), None)
            if miss is None:
                return seq[: end + 1], res, True
            seq = seq[: miss + 1] + pred[miss:]
        return seq[: miss + 1], res, False

    def ruler_suite(self, bar=None, on_sample=None) -> list[dict]:
        """Every policy's greedy output on each RULER sample, scored; `on_sample(rows_so_far)`
        after each sample (a long run keeps what it measured)."""
        from infinigen.eval.ruler import TASKS, ruler_samples, ruler_score

        st = self.settings
        runs = policy_configs(st)
        stop = {t for t in (self.tokenizer.eos_token_id,) if t is not None}
        out = []
        for length in st.ruler_lengths:
            for task in st.ruler_tasks or tuple(TASKS):
                n = TASKS[task].max_new_tokens
                for sample in ruler_samples(self.tokenizer, task, length, st.ruler_samples):
                    ids = self.tokenizer(sample.prompt, add_special_tokens=False).input_ids
                    prefix = self.ev.prefill(torch.tensor(ids)[None])
                    dense = self.dense_greedy(prefix, n)
                    full_bytes = full_fetch_bytes_per_token(self.ev.adapter, len(ids) + (n - 2) / 2, st.kv_dtype)
                    for label, budget, cfg in runs:
                        if cfg.spec.placement == "compute":  # its output ends where it emits a stop token
                            end = next((j + 1 for j, t in enumerate(dense) if t in stop), n)
                            tokens, extra, exact = dense[:end], {}, True
                        else:
                            tokens, res, exact = self.policy_greedy(prefix, dense, cfg, stop)
                            extra = _row(res, None, None, full_bytes)
                        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                        out.append(
                            {
                                "suite": "ruler",
                                "task": task,
                                "length": length,
                                "prompt_tokens": len(ids),
                                "sample": sample.index,
                                "policy": label,
                                "budget": budget,
                                "score": ruler_score(task, text, sample.answers),
                                "exact": exact,
                                "output": text,
                                "answers": sample.answers,
                                **{k: extra.get(k) for k in ("fetched_fraction", "bytes_fraction")},
                            }
                        )
                    if bar is not None:
                        bar.update(1)
                    if on_sample is not None:
                        on_sample(out)
        return out

    # ---------------------------------------------------------------- sensitivity
    def sensitivity_suite(self, bar=None) -> list[dict]:
        """InfiniGen alone, uncapped, on one essays window: alpha, partial ratio, skew."""
        from infinigen.eval.datasets import text_windows

        st = self.settings
        ctx = st.sensitivity_context
        ids = torch.tensor(text_windows(self.tokenizer, "essays", ctx, 1)[0])
        common = dict(st.base, kv_dtype=st.kv_dtype)
        runs = [(f"alpha={a:g}", None, InfiniGenConfig(alpha=float(a), **common)) for a in st.alphas]
        runs += [(f"ratio={r:g}", None, InfiniGenConfig(partial_ratio=float(r), **common)) for r in st.ratios]
        runs += [("skew=off", None, InfiniGenConfig(skew=False, **common))]
        rows = []
        for label, _, cfg in runs:
            row = self.ppl_window(ids, [("infinigen", None, cfg)])[0]
            kind, value = label.split("=")
            rows.append(
                {"suite": "sensitivity", "dataset": "essays", "context": ctx, "knob": kind, "value": value, **row}
            )
            if bar is not None:
                bar.update(1)
        return rows

    def variants_suite(self, bar=None) -> list[dict]:
        """InfiniGen variants at one matched budget — the fixes the per-layer data suggests:
        GQA aggregation (max, or the summed estimated probability mass the oracle ranks by), a
        larger partial ratio, one more dense layer, no skew — next to the oracle, and Quest with
        smaller pages (a check on where Quest loses). partial_ratio=1.0 keeps every channel, so
        what it still loses against the oracle comes from speculating with the previous layer's
        input."""
        from infinigen.eval.datasets import text_windows

        st = self.settings
        b = st.variant_budget
        common = dict(st.base, kv_dtype=st.kv_dtype, alpha=math.inf, budget=b)
        variants = (
            list(st.variants)
            if st.variants is not None
            else [
                (DEFAULT_VARIANT, {}),
                ("aggregation=max", {"aggregation": "max"}),
                ("aggregation=mass", {"aggregation": "mass"}),
                ("partial_ratio=0.5", {"partial_ratio": 0.5}),
                ("aggregation=mass, partial_ratio=0.5", {"aggregation": "mass", "partial_ratio": 0.5}),
                ("partial_ratio=1.0", {"partial_ratio": 1.0}),
                ("dense_layers=3", {"dense_layers": 3}),
                ("skew=off", {"skew": False}),
            ]
        )
        rows = []
        contexts = st.contexts if st.variants is not None else (st.sensitivity_context,)
        for ds in st.datasets:
            for ctx in contexts:
                runs = [("dense", None, InfiniGenConfig(policy="dense"))]
                runs += [
                    ("oracle", b, InfiniGenConfig(policy="oracle", budget=b, kv_dtype=st.kv_dtype, block_tokens=1))
                ]
                runs += [(name, kw.get("budget", b), InfiniGenConfig(**{**common, **kw})) for name, kw in variants]
                if st.variants is None:
                    # Quest's loss comes from its page bound, not from being query-aware: smaller pages.
                    for page in (4, 1):
                        cfg = InfiniGenConfig(policy="quest", budget=b, page_tokens=page, kv_dtype=st.kv_dtype)
                        runs.append((f"quest page_tokens={page}", b, cfg))
                for w, win in enumerate(text_windows(self.tokenizer, ds, ctx, st.windows)):
                    for row in self.ppl_window(torch.tensor(win), runs):
                        rows.append({"suite": "variants", "dataset": ds, "context": ctx, "window": w, **row})
                    if bar is not None:
                        bar.update(1)
        return rows

    def run(self, suites: tuple[str, ...], on_suite=None) -> list[dict]:
        """All requested suites; `on_suite(rows_so_far)` after each (to save partial results)."""
        st = self.settings
        work = 0
        if "ppl" in suites:
            work += len(st.datasets) * len(st.contexts) * st.windows
        for task in ("passkey", "needle"):
            if task in suites:
                work += len(st.retrieval_lengths) * len(st.depths)
        if "sensitivity" in suites:
            work += len(st.alphas) + len(st.ratios) + 1
        if "variants" in suites:
            work += len(st.datasets) * (len(st.contexts) if st.variants is not None else 1) * st.windows
        if "ruler" in suites:
            from infinigen.eval.ruler import TASKS

            work += len(st.ruler_lengths) * len(st.ruler_tasks or TASKS) * st.ruler_samples
        rows: list[dict] = []
        with tqdm(total=work, desc="eval", disable=not self.progress) as bar, self.ev:
            if "ppl" in suites:
                rows += self.ppl_suite(bar)
                if on_suite:
                    on_suite(rows)
            for task in ("passkey", "needle"):
                if task in suites:
                    rows += self.retrieval_suite(task, bar)
                    if on_suite:
                        on_suite(rows)
            if "sensitivity" in suites:
                rows += self.sensitivity_suite(bar)
                if on_suite:
                    on_suite(rows)
            if "variants" in suites:
                rows += self.variants_suite(bar)
                if on_suite:
                    on_suite(rows)
            if "ruler" in suites:
                done = list(rows)
                rows += self.ruler_suite(bar, (lambda part: on_suite(done + part)) if on_suite else None)
        return rows
