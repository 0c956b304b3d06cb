"""Benchmark (not a test): vLLM's own CPU backend against the plugin (full fetch, InfiniGen, and the
oracle as the quality bound), side by side in one run, each row in its own process at the same KV
memory. Prints a table and writes JSON (commit, machine, settings).

    python -m infinigen.integrations.vllm.bench --context 8000 --batches 1,8 --new 32 --memory-gib 1

Per row: decode tokens/s at each batch (every prompt prefills in one step, then the batch decodes
together: new tokens each over the span from the first token to the last, vLLM's own timestamps), vLLM's blocks at the same KV memory and the pool's bytes, the concurrent sequences of
that context they hold, bytes read from the slow tier per token, peak RSS, greedy tokens equal to
vLLM's own, and the KL from vLLM's own distribution with the tokens forced to its greedy ones
(full vocabulary, teacher forced through a logits processor).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = {
    "vllm": None,
    "full": "policy=full",
    "infinigen": "policy=infinigen",
    "oracle": "policy=oracle",
}


def _child(args) -> None:
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class ForceTokens(LogitsProcessor):
        """Teacher forcing: a request whose extra_args name `force` takes those tokens in turn."""

        def __init__(self, vllm_config, device, is_pin_memory):
            self.rows: dict[int, tuple[list[int], list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            if batch_update is None:
                return
            for i in batch_update.removed:
                self.rows.pop(i, None)
            for i, params, _, out in batch_update.added:
                force = (params.extra_args or {}).get("force") if params else None
                if force:
                    self.rows[i] = (force, out)
                else:
                    self.rows.pop(i, None)
            for a, b, _ in batch_update.moved:
                ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
                if ra is not None:
                    self.rows[b] = ra
                if rb is not None:
                    self.rows[a] = rb

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for i, (force, out) in self.rows.items():
                t = force[min(len(out), len(force) - 1)]
                logits[i] = float("-inf")
                logits[i, t] = 0.0
            return logits

    cfg = json.loads(args.child)
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    text = Path(cfg["text"]).read_text()
    ids = tok(text)["input_ids"]
    ctx, new = cfg["context"], cfg["new"]
    stride = max(1, (len(ids) - ctx) // max(1, max(cfg["batches"]) - 1))
    prompts = [
        TokensPrompt(prompt_token_ids=(ids * 2)[i * stride : i * stride + ctx]) for i in range(max(cfg["batches"]))
    ]
    llm = LLM(
        model=cfg["model"], dtype=cfg["dtype"], enforce_eager=True, max_model_len=ctx + new + 8,
        max_num_batched_tokens=max(cfg["batches"]) * (ctx + new + 8), enable_prefix_caching=False, max_logprobs=-1,
        logits_processors=[ForceTokens], seed=0, disable_log_stats=False,
    )  # fmt: skip
    from infinigen.integrations.vllm import plugin

    vc = llm.llm_engine.vllm_config
    hf = vc.model_config.hf_config
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    d = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    block = vc.cache_config.block_size
    blocks = vc.cache_config.num_gpu_blocks
    per_token = kv_heads * hf.num_hidden_layers * _page(cfg["row"], d, cfg["dtype"])
    out = {
        "row": cfg["row"], "blocks": blocks, "block_size": block, "pool_bytes": blocks * block * per_token,
        "pool_bytes_per_token": per_token, "concurrent": blocks // -(-(ctx + new) // block),
        "dense_kv_bytes_per_token": kv_heads * hf.num_hidden_layers * 2 * d * (2 if cfg["dtype"] != "float32" else 4),
        "batches": {},
    }  # fmt: skip
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    for b in cfg["batches"]:
        # Every prompt prefills in one step (the batched-token limit holds them all), then the batch
        # decodes together: the decode is the span from the first token to the last.
        many = SamplingParams(temperature=0, max_tokens=1 + new, ignore_eos=True)
        rt = plugin.current()
        before = rt.describe() if rt else None
        t0 = time.perf_counter()
        res = llm.generate(prompts[:b], many, use_tqdm=False)
        t1 = time.perf_counter()
        after = rt.describe() if rt else None
        first = max(r.metrics.first_token_ts for r in res)
        last = max(r.metrics.last_token_ts for r in res)
        decode = last - first
        row = {"tok_s": b * new / decode, "decode_s": decode, "prefill_s": first - min(r.metrics.scheduled_ts for r in res),
               "wall_s": t1 - t0, "tokens": [list(r.outputs[0].token_ids) for r in res]}  # fmt: skip
        if after is not None:
            steps = b * new
            row["bytes_read_per_token"] = (after["bytes_read"] - before["bytes_read"]) / steps
            attended = after["rows_attended"] - before["rows_attended"]
            row["attended_share"] = attended / max(1, after["rows_context"] - before["rows_context"])
            row["store_written_bytes"] = after["store_written_bytes"]
        out["batches"][str(b)] = row
    if cfg.get("force") or cfg["row"] == "vllm":  # vLLM's own greedy run is its forced one
        force = cfg.get("force")
        forced = SamplingParams(temperature=0, max_tokens=len(force) if force else 1 + new, ignore_eos=True,
                                logprobs=-1, extra_args={"force": force} if force else None)  # fmt: skip
        res = llm.generate(prompts[:1], forced, use_tqdm=False)[0].outputs[0]
        vocab = len(res.logprobs[0])
        dist = torch.full((len(res.logprobs), vocab), float("-inf"))
        for j, lp in enumerate(res.logprobs):
            idx = torch.tensor(list(lp.keys()))
            dist[j, idx] = torch.tensor([v.logprob for v in lp.values()])
        torch.save(dist.to(torch.float32), cfg["dist"])
        out["forced_tokens"] = list(res.token_ids)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(cfg["out"]).write_text(json.dumps(out))


def _page(row: str, d: int, dtype: str) -> int:
    """Bytes per (token, KV head, layer) of the pool vLLM allocates for a row."""
    from infinigen.integrations.vllm.runtime import page_bytes, placeholder_bytes
    from infinigen.integrations.vllm.settings import from_env
    from infinigen.speculate import channel_count

    s = from_env()
    itemsize = 4 if dtype == "float32" else 2
    if s is None:
        return 2 * d * itemsize
    if s.keeps_partial_keys:
        return page_bytes(channel_count(s.config.partial_ratio, d), itemsize)
    return placeholder_bytes(itemsize)


def _kl(p, q) -> float:
    """Mean over positions of KL(p || q) from log-probabilities [T, V]."""
    import torch

    pp = p.exp()
    return float(torch.where(pp > 0, pp * (p - q.clamp(min=-1e30)), torch.zeros_like(p)).sum(-1).mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M, converted once)")
    ap.add_argument("--text", default=None, help="prompt text (default: the package's essay)")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--memory-gib", type=float, default=1.0, help="vLLM's KV memory (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--json", default="vllm-bench.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    import torch

    from infinigen.loading import convert_gguf, smollm2_gguf
    from infinigen.provenance import commit, machine

    model = args.model or str(convert_gguf(smollm2_gguf()))
    text = args.text or str(Path(__file__).resolve().parents[2] / "data" / "areopagitica.txt")
    batches = [int(b) for b in args.batches.split(",")]
    results, work = {}, Path(tempfile.mkdtemp(prefix="infinigen-vllm-bench-"))
    dense_tokens = None
    for row in args.rows.split(","):
        env = {k: v for k, v in os.environ.items() if k != "INFINIGEN_VLLM"}
        if ROWS[row] is not None:
            env["INFINIGEN_VLLM"] = ROWS[row]
        # One process (the plugin's counters and the peak RSS are the row's own); every row on the
        # machine's cores (vLLM's CPU worker drops to one thread unless told).
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=f"{args.memory_gib:g}",
                   OMP_NUM_THREADS=str(os.cpu_count()))  # fmt: skip
        cfg = dict(row=row, model=model, text=text, context=args.context, new=args.new, batches=batches,
                   dtype=args.dtype, out=str(work / f"{row}.json"), dist=str(work / f"{row}.pt"),
                   force=dense_tokens)  # fmt: skip
        print(f"[bench vllm] {row} ...", file=sys.stderr, flush=True)
        done = subprocess.run(
            [sys.executable, "-m", "infinigen.integrations.vllm.bench", "--child", json.dumps(cfg)], env=env
        )
        if done.returncode:
            raise SystemExit(f"row {row} failed (exit {done.returncode})")
        results[row] = json.loads((work / f"{row}.json").read_text())
        if row == "vllm":
            dense_tokens = results[row]["forced_tokens"]
    if "vllm" in results:
        ref_dist = torch.load(work / "vllm.pt") if (work / "vllm.pt").exists() else None
        ref = results["vllm"]
        for row, r in results.items():
            for b, br in r["batches"].items():
                mine, theirs = br["tokens"], ref["batches"][b]["tokens"]
                same = sum(x == y for m, t in zip(mine, theirs) for x, y in zip(m, t))
                first = [
                    next((j for j, (x, y) in enumerate(zip(m, t)) if x != y), len(t)) for m, t in zip(mine, theirs)
                ]
                br["tokens_equal_share"] = same / sum(len(t) for t in theirs)
                br["first_divergence_mean"] = sum(first) / len(first)
                br["speed_vs_vllm"] = br["tok_s"] / ref["batches"][b]["tok_s"]
            if ref_dist is not None and (work / f"{row}.pt").exists():
                r["kl_vs_vllm"] = _kl(ref_dist, torch.load(work / f"{row}.pt"))
                if (work / "full.pt").exists():  # against the plugin's own full fetch: the same arithmetic
                    r["kl_vs_full"] = _kl(torch.load(work / "full.pt"), torch.load(work / f"{row}.pt"))
        if "kl_vs_full" in results.get("oracle", {}):
            for r in results.values():
                if "kl_vs_full" in r:
                    r["kl_x_oracle"] = r["kl_vs_full"] / results["oracle"]["kl_vs_full"]
    report = {
        "settings": vars(args) | {"model": model, "text": text},
        "commit": commit(),
        "machine": machine(),
        "rows": results,
    }
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(_table(results, batches, args))
    print(f"wrote {args.json}")
    return 0


def _table(results: dict, batches: list[int], args) -> str:
    mib = 1 << 20
    lines = [
        f"vLLM CPU, {args.context} tokens of context, {args.new} new, KV memory {args.memory_gib:g} GiB, {args.dtype}",
        "| row | blocks | sequences of the context | pool MiB | pool bytes/token (% dense) | "
        + " | ".join(f"B={b} tok/s (x vLLM)" for b in batches)
        + " | MiB read/token | peak RSS MiB | tokens = vLLM's | KL vs vLLM | KL vs full (x oracle) |",
        "|" + "---|" * (10 + len(batches)),
    ]
    for row, r in results.items():
        speeds = " | ".join(
            f"{r['batches'][str(b)]['tok_s']:.2f} ({r['batches'][str(b)].get('speed_vs_vllm', float('nan')):.2f})"
            for b in batches
        )
        last = r["batches"][str(batches[-1])]
        read = last.get("bytes_read_per_token")
        share = r["pool_bytes_per_token"] / r["dense_kv_bytes_per_token"]
        lines.append(
            f"| {row} | {r['blocks']} | {r['concurrent']} | {r['pool_bytes'] / mib:.0f} | "
            f"{r['pool_bytes_per_token']} ({share:.1%}) | {speeds} | "
            f"{'-' if read is None else f'{read / mib:.1f}'} | {r['peak_rss_bytes'] / mib:.0f} | "
            f"{last.get('tokens_equal_share', float('nan')):.0%} | {r.get('kl_vs_vllm', float('nan')):.4f} | "
            f"{r.get('kl_vs_full', float('nan')):.4f} ({r.get('kl_x_oracle', float('nan')):.2f}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
