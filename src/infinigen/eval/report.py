"""Tables (markdown) and plots (PNG) from the rows `infinigen eval` measured."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from infinigen.figures import pyplot

DEFAULT_VARIANT = "default (union, r=0.3, skew)"


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _label(r: dict) -> str:
    return r["policy"] if r.get("budget") is None else f"{r['policy']}@{r['budget']:g}"


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def ppl_tables(rows: list[dict]) -> str:
    ppl = [r for r in rows if r["suite"] == "ppl"]
    out = []
    groups = defaultdict(list)
    for r in ppl:
        groups[(r["dataset"], r["context"])].append(r)
    for (ds, ctx), rs in groups.items():
        by = defaultdict(list)
        for r in rs:
            by[(r["policy"], r["budget"])].append(r)
        dense_ppl = _mean([r["ppl"] for r in rs if r["policy"] == "dense"])
        out.append(
            f"\n### {ds}, {ctx} tokens (last positions teacher-forced; windows: {len({r['window'] for r in rs})})\n"
        )
        out.append(
            "| policy | budget | positions fetched | bytes vs full | ppl | Δppl vs dense | x oracle's Δppl "
            "| top-1 agr. | KL | recall |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        oracle = {b: _mean([r["ppl"] for r in g]) for (p, b), g in by.items() if p == "oracle"}
        for (p, b), g in by.items():
            ppl_v = _mean([r["ppl"] for r in g])
            delta = None if dense_ppl is None or ppl_v is None else (ppl_v / dense_ppl - 1) * 100
            o = oracle.get(b)
            ratio = None
            if p != "oracle" and None not in (o, ppl_v, dense_ppl) and o != dense_ppl:
                ratio = (ppl_v - dense_ppl) / (o - dense_ppl)
            out.append(
                f"| {p} | {_f(b, '.0%') if b is not None else '-'} | {_f(_mean([r['fetched_fraction'] for r in g]), '.1%')} "
                f"| {_f(_mean([r['bytes_fraction'] for r in g]), '.1%')} | {_f(ppl_v, '.2f')} | {_f(delta, '+.1f')}% "
                f"| {_f(ratio, '.2f')} | {_f(_mean([r.get('top1_agreement') for r in g]))} "
                f"| {_f(_mean([r.get('kl') for r in g]))} | {_f(_mean([r.get('recall') for r in g]))} |"
            )
    return "\n".join(out)


def ruler_table(rows: list[dict]) -> str:
    """RULER: mean string-match score (0-100) per task and policy, one table per length."""
    rs = [r for r in rows if r["suite"] == "ruler"]
    out = []
    for length in sorted({r["length"] for r in rs}):
        g = [r for r in rs if r["length"] == length]
        tasks = list(dict.fromkeys(r["task"] for r in g))
        labels = list(dict.fromkeys(_label(r) for r in g))
        n = len({r["sample"] for r in g})
        inexact = sum(not r["exact"] for r in g)
        out.append(f"\n### {length} tokens ({n} samples per task; outputs not confirmed in full: {inexact})\n")
        out.append("| policy | fetched | " + " | ".join(tasks) + " | mean |")
        out.append("|---|---|" + "---|" * (len(tasks) + 1))
        for lab in labels:
            cells = [_mean([r["score"] for r in g if _label(r) == lab and r["task"] == t]) for t in tasks]
            frac = _mean([r.get("fetched_fraction") for r in g if _label(r) == lab])
            out.append(
                f"| {lab} | {_f(frac, '.1%')} | "
                + " | ".join(_f(c, ".1f") for c in cells)
                + f" | {_f(_mean(cells), '.1f')} |"
            )
    return "\n".join(out)


def retrieval_tables(rows: list[dict]) -> str:
    out = []
    for task in ("passkey", "needle"):
        rs = [r for r in rows if r["suite"] == task]
        if not rs:
            continue
        lengths = sorted({r["length"] for r in rs})
        depths = sorted({r["depth"] for r in rs})
        out.append(f"\n### {task}: correct of {len(depths)} depths ({', '.join(f'{d:g}' for d in depths)})\n")
        out.append("| policy | " + " | ".join(str(n) for n in lengths) + " |")
        out.append("|---|" + "---|" * len(lengths))
        labels = list(dict.fromkeys(_label(r) for r in rs))
        for lab in labels:
            cells = []
            for n in lengths:
                g = [r for r in rs if _label(r) == lab and r["length"] == n]
                cells.append(f"{sum(r['correct'] for r in g)}/{len(g)}")
            out.append(f"| {lab} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def sensitivity_table(rows: list[dict]) -> str:
    rs = [r for r in rows if r["suite"] == "sensitivity"]
    if not rs:
        return ""
    dense = next((r for r in rows if r["suite"] == "ppl" and r["policy"] == "dense"), None)
    out = [f"\n### InfiniGen sensitivity (essays, {rs[0]['context']} tokens, no budget cap)\n"]
    out.append("| knob | value | positions fetched | ppl | top-1 agr. | KL | recall |")
    out.append("|---|---|---|---|---|---|---|")
    for r in rs:
        out.append(
            f"| {r['knob']} | {r['value']} | {_f(r['fetched_fraction'], '.1%')} | {_f(r['ppl'], '.2f')} "
            f"| {_f(r.get('top1_agreement'))} | {_f(r.get('kl'))} | {_f(r.get('recall'))} |"
        )
    del dense
    return "\n".join(out)


def variants_table(rows: list[dict]) -> str:
    """Per text and context, each variant's mean over the windows (`--windows`), next to dense
    and the oracle at the same budget."""
    rs = [r for r in rows if r["suite"] == "variants"]
    if not rs:
        return ""
    out = []
    for ds, ctx in dict.fromkeys((r["dataset"], r["context"]) for r in rs):
        g = [r for r in rs if r["dataset"] == ds and r["context"] == ctx]
        by: dict[str, list[dict]] = defaultdict(list)
        for r in g:
            by[r["policy"]].append(r)
        mean = {p: {k: _mean([r.get(k) for r in v]) for k in ("ppl", "kl")} for p, v in by.items()}
        dense = mean.get("dense", {}).get("ppl")
        oracle = mean.get("oracle", {})
        windows = len({r.get("window", 0) for r in g})
        out.append(
            f"\n### {ds}, {ctx} tokens, budget {next(r['budget'] for r in g if r['budget']):.0%}"
            + (f" (mean over {windows} windows)" if windows > 1 else "")
            + "\n"
        )
        out.append(
            "| variant | positions fetched | ppl | Δppl vs dense | x oracle's Δppl | top-1 agr. | KL | x oracle's KL "
            "| recall |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        for p, v in by.items():
            ppl_v, kl_v = mean[p]["ppl"], mean[p]["kl"]
            delta = None if dense is None else (ppl_v / dense - 1) * 100
            ratio = kl_ratio = None
            if p != "dense":
                if dense is not None and oracle.get("ppl") not in (None, dense):
                    ratio = (ppl_v - dense) / (oracle["ppl"] - dense)
                if kl_v is not None and oracle.get("kl"):
                    kl_ratio = kl_v / oracle["kl"]
            out.append(
                f"| {p} | {_f(_mean([r['fetched_fraction'] for r in v]), '.1%')} | {_f(ppl_v, '.2f')} "
                f"| {_f(delta, '+.1f')}% | {_f(ratio, '.2f')} | {_f(_mean([r.get('top1_agreement') for r in v]))} "
                f"| {_f(kl_v)} | {_f(kl_ratio, '.2f')} | {_f(_mean([r.get('recall') for r in v]))} |"
            )
    return "\n".join(out)


def layer_table(
    rows: list[dict], budget: float = 0.1, worst: int = 8, suite: str = "ppl", label: str = "infinigen"
) -> str:
    """Where InfiniGen loses attention mass: per-layer recall next to the oracle's at the same
    budget (mean over the suite's windows), the layers with the largest gap, and their worst heads."""
    ppl = [r for r in rows if r["suite"] == suite and r.get("budget") == budget]
    ig = [r for r in ppl if r["policy"] == label and r.get("per_layer_recall")]
    orc = [r for r in ppl if r["policy"] == "oracle" and r.get("per_layer_recall")]
    if not ig or not orc:
        return ""
    layers = sorted(ig[0]["per_layer_recall"], key=int)
    rec = {k: _mean([r["per_layer_recall"].get(k) for r in ig]) for k in layers}
    best = {k: _mean([r["per_layer_recall"].get(k) for r in orc]) for k in layers}
    frac = {k: _mean([r["per_layer_fraction"].get(k) for r in ig]) for k in layers}
    gap = sorted(layers, key=lambda k: rec[k] - best[k])[:worst]
    out = [
        f"\n### Where InfiniGen loses recall (budget {budget:.0%}, mean over the {suite} windows)\n",
        "| layer | infinigen recall | oracle recall | gap | worst heads (recall) |",
        "|---|---|---|---|---|",
    ]
    for k in gap:
        per_run = [r["per_head_recall"][k] for r in ig if k in r.get("per_head_recall", {})]
        heads = [_mean(v) for v in zip(*per_run, strict=True)] if per_run else []
        worst_heads = sorted(range(len(heads)), key=lambda h: heads[h])[:3]
        out.append(
            f"| {k} | {rec[k]:.3f} | {best[k]:.3f} | {rec[k] - best[k]:+.3f} | "
            + ", ".join(f"h{h} {heads[h]:.2f}" for h in worst_heads)
            + " |"
        )
    out.append(
        f"\nAll layers ({'/'.join(['recall', 'oracle', 'fetched'])}): "
        + "; ".join(f"{k}: {rec[k]:.2f}/{best[k]:.2f}/{frac[k]:.0%}" for k in layers)
    )
    return "\n".join(out)


def markdown(rows: list[dict], meta: dict[str, Any], targets: str = "") -> str:
    head = [
        "# infinigen eval",
        "",
        f"model {meta.get('model')}, commit {meta.get('commit')}, {meta.get('machine')}, "
        f"KV stored as {meta.get('kv_dtype')}; command: `{meta.get('command')}`",
        "",
        "Every number is measured through the project's teacher-forced evaluator (equal to the",
        "step-by-step decode path, `tests/test_forced.py`). 'bytes vs full' is KV bytes read per",
        "token over what fetching every layer's whole KV at the same storage dtype reads.",
    ]
    parts = ["\n".join(head)]
    if targets:
        parts.append(targets)
    if any(r["suite"] == "ppl" for r in rows):
        parts.append("## Perplexity, agreement with dense, recall\n" + ppl_tables(rows))
    if any(r["suite"] in ("passkey", "needle") for r in rows):
        parts.append("## Retrieval\n" + retrieval_tables(rows))
    if any(r["suite"] == "ruler" for r in rows):
        parts.append("## RULER (string match, 0-100)\n" + ruler_table(rows))
    lt = layer_table(rows)
    if any(r["suite"] == "variants" for r in rows):
        lt += "\n" + layer_table(rows, suite="variants", label=DEFAULT_VARIANT)
    if lt.strip():
        parts.append("## Per layer and head\n" + lt)
    if any(r["suite"] == "sensitivity" for r in rows):
        parts.append("## Sensitivity\n" + sensitivity_table(rows))
    if any(r["suite"] == "variants" for r in rows):
        parts.append("## InfiniGen variants at a matched budget\n" + variants_table(rows))
    return "\n\n".join(parts) + "\n"


def plots(rows: list[dict], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    written = []
    ppl = [r for r in rows if r["suite"] == "ppl"]
    if ppl:
        groups = sorted({(r["dataset"], r["context"]) for r in ppl})
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
        for ax, (ds, ctx) in zip(axes[0], groups, strict=True):
            rs = [r for r in ppl if r["dataset"] == ds and r["context"] == ctx]
            dense = _mean([r["ppl"] for r in rs if r["policy"] == "dense"])
            for p in dict.fromkeys(r["policy"] for r in rs):
                if p == "dense":
                    continue
                pts = defaultdict(list)
                for r in rs:
                    if r["policy"] == p:
                        pts[r["budget"]].append((r["bytes_fraction"], r["ppl"]))
                xy = sorted((_mean([a for a, _ in v]), _mean([b for _, b in v])) for v in pts.values())
                ax.plot([a for a, _ in xy], [b for _, b in xy], marker="o", label=p)
            if dense is not None:
                ax.axhline(dense, color="k", linestyle="--", linewidth=1, label="dense")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("KV bytes read per token / full fetch")
            ax.set_ylabel("perplexity")
            ax.set_title(f"{ds}, {ctx} tokens")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / "quality_vs_fetched.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    for task in ("passkey", "needle"):
        rs = [r for r in rows if r["suite"] == task]
        if not rs:
            continue
        budgets = sorted({r["budget"] for r in rs if r["budget"] is not None}) or [None]
        fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
        for ax, b in zip(axes[0], budgets, strict=True):
            for lab in dict.fromkeys(_label(r) for r in rs if r["budget"] in (b, None)):
                g = [r for r in rs if _label(r) == lab]
                lengths = sorted({r["length"] for r in g})
                acc = [_mean([float(r["correct"]) for r in g if r["length"] == n]) for n in lengths]
                ax.plot(lengths, acc, marker="o", label=lab)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.05, 1.05)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("accuracy")
            ax.set_title(f"{task}, budget {b:.0%}" if b is not None else task)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{task}_vs_length.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    sens = [r for r in rows if r["suite"] == "sensitivity"]
    if sens:
        knobs = list(dict.fromkeys(r["knob"] for r in sens if r["knob"] != "skew"))
        fig, axes = plt.subplots(2, len(knobs), figsize=(5 * len(knobs), 7), squeeze=False)
        base = [r for r in sens if r["knob"] == "skew"]
        for j, knob in enumerate(knobs):
            rs = sorted((r for r in sens if r["knob"] == knob), key=lambda r: float(r["value"]))
            xs = [float(r["value"]) for r in rs]
            axes[0][j].plot(xs, [r["fetched_fraction"] for r in rs], marker="o")
            axes[0][j].set_ylabel("positions fetched")
            axes[1][j].plot(xs, [r["ppl"] for r in rs], marker="o", label="skew on")
            if base and knob == "alpha":
                axes[1][j].axhline(base[0]["ppl"], color="r", linestyle=":", label="skew off (alpha default)")
            axes[1][j].set_ylabel("perplexity")
            axes[1][j].set_xlabel(knob)
            axes[1][j].legend(fontsize=7)
        fig.tight_layout()
        path = out / "sensitivity.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
