"""The quality targets, checked on measured rows (met or missed, with the numbers)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

TOL = 0.005  # fraction fetched: ceil(budget * context) positions lands a hair over the budget


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _by_label(rows: list[dict]) -> dict[tuple[str, float | None], dict[str, float | None]]:
    """Mean ppl, fetched fraction, bytes fraction, recall per (policy, budget)."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["policy"], r["budget"])].append(r)
    return {
        k: {m: _mean([r.get(m) for r in g]) for m in ("ppl", "fetched_fraction", "bytes_fraction", "recall")}
        for k, g in groups.items()
    }


def check_targets(rows: list[dict]) -> dict[str, Any]:
    checks: list[dict[str, Any]] = []
    ppl_rows = [r for r in rows if r["suite"] == "ppl"]
    groups = defaultdict(list)
    for r in ppl_rows:
        groups[(r["dataset"], r["context"])].append(r)
    for (ds, ctx), rs in groups.items():
        m = _by_label(rs)
        where = f"{ds} {ctx}"
        dense = m.get(("dense", None), {}).get("ppl")
        if dense is None:
            continue
        ig10, or10 = m.get(("infinigen", 0.1)), m.get(("oracle", 0.1))
        if ig10 and or10:
            d_ig, d_or = ig10["ppl"] - dense, or10["ppl"] - dense
            checks.append(
                {
                    "where": where,
                    "target": "Δppl at 10% budget <= 1.5 x oracle's",
                    "measured": f"dense {dense:.2f}; infinigen {d_ig:+.2f} at {ig10['fetched_fraction']:.1%} fetched, "
                    f"oracle {d_or:+.2f} at {or10['fetched_fraction']:.1%}",
                    "met": d_ig <= 1.5 * d_or,
                }
            )
        ig = {b: v for (p, b), v in m.items() if p == "infinigen"}
        within = [
            (v["ppl"] / dense - 1, b, v["fetched_fraction"])
            for b, v in ig.items()
            if v["fetched_fraction"] <= 0.2 + TOL
        ]
        if within:
            best = min(within)
            checks.append(
                {
                    "where": where,
                    "target": "ppl within 2% of dense at <= 20% fetched",
                    "measured": f"best +{best[0]:.1%} (budget {best[1]:g}, {best[2]:.1%} fetched)",
                    "met": best[0] <= 0.02,
                }
            )
        rec = [
            (v["recall"], b, v["fetched_fraction"])
            for b, v in ig.items()
            if v["fetched_fraction"] <= 0.15 + TOL and v["recall"]
        ]
        if rec:
            best = max(rec)
            checks.append(
                {
                    "where": where,
                    "target": "attention recall >= 0.9 at <= 15% fetched",
                    "measured": f"best {best[0]:.3f} (budget {best[1]:g}, {best[2]:.1%} fetched)",
                    "met": best[0] >= 0.9,
                }
            )
        for rival in ("h2o", "streaming"):
            pairs = [(b, ig[b]["ppl"], v["ppl"]) for (p, b), v in m.items() if p == rival and b in ig]
            if pairs:
                checks.append(
                    {
                        "where": where,
                        "target": f"ppl below {rival} at every budget",
                        "measured": ", ".join(f"{b:g}: {a:.2f} vs {c:.2f}" for b, a, c in sorted(pairs)),
                        "met": all(a < c for _, a, c in pairs),
                    }
                )
        int4 = m.get(("int4", None))
        if int4 and ig:
            b_max = max(ig)
            checks.append(
                {
                    "where": where,
                    "target": "ppl below int4 with fewer bytes",
                    "measured": f"infinigen@{b_max:g} {ig[b_max]['ppl']:.2f} at {ig[b_max]['bytes_fraction']:.1%} bytes, "
                    f"int4 {int4['ppl']:.2f} at {int4['bytes_fraction']:.1%}",
                    "met": ig[b_max]["ppl"] < int4["ppl"] and ig[b_max]["bytes_fraction"] <= int4["bytes_fraction"],
                }
            )
    for task in ("passkey", "needle"):
        rs = [r for r in rows if r["suite"] == task]
        dense = {(r["length"], r["depth"]): r["correct"] for r in rs if r["policy"] == "dense"}
        if not dense:
            continue
        for b in sorted({r["budget"] for r in rs if r["policy"] == "infinigen"}):
            ig = {
                (r["length"], r["depth"]): r["correct"] for r in rs if r["policy"] == "infinigen" and r["budget"] == b
            }
            same = sum(ig[k] == dense[k] for k in dense if k in ig)
            checks.append(
                {
                    "where": f"{task} up to {max(k[0] for k in dense)}",
                    "target": f"infinigen@{b:g} correct wherever dense is",
                    "measured": f"{sum(ig.values())}/{len(ig)} correct (dense {sum(dense.values())}/{len(dense)}); "
                    f"same outcome on {same}/{len(dense)}",
                    "met": all(ig.get(k, False) or not v for k, v in dense.items()),
                }
            )
            for rival in ("h2o", "streaming", "int4"):
                rv = [r["correct"] for r in rs if r["policy"] == rival and r["budget"] in (b, None)]
                if rv:
                    checks.append(
                        {
                            "where": task,
                            "target": f"infinigen@{b:g} retrieves at least as often as {rival}",
                            "measured": f"{sum(ig.values())} vs {sum(rv)} of {len(rv)}",
                            "met": sum(ig.values()) >= sum(rv),
                        }
                    )
    lines = ["## Targets\n", "| where | target | measured | result |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['where']} | {c['target']} | {c['measured']} | {'met' if c['met'] else 'missed'} |")
    return {"checks": checks, "markdown": "\n".join(lines) if checks else ""}
