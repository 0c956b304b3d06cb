"""`infinigen bench capacity`: for a memory budget next to the compute (`--memory`), the largest
batch each policy can serve at a context, then a real decode there: tokens/s, bytes moved and
peak RSS. `--budget` is, as in every command, the fraction of the context a policy reads per step.

The capacity comes from the same plan a cache makes (`infinigen.budget.plan` with
`compute_memory` = the memory budget): the largest batch whose KV-related bytes with the compute fit,
after the plan gives up what it may (block cache, partial-key precision). `int4` is the
quantized-KV baseline kept *with* the compute, so its packed KV counts against the budget;
`dense` keeps every layer whole in the KV's storage dtype. Then each policy decodes at its
largest batch in a child process (`bench decode`'s child, the same replayed prefill), with the
budget in its config, and the row reports what it measured: tokens/s, bytes read per token, what
it kept with the compute, and its peak resident set against weights + budget.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

import torch

from infinigen.bench.decode import _prompt_ids, _run_child, policy_configs, run_settings, save_prefill
from infinigen.budget import MemoryBudgetError, Request, plan
from infinigen.cli_settings import DISK_DEFAULTS, add_arguments
from infinigen.config import POLICIES
from infinigen.memory import dense_kv_bytes, format_bytes
from infinigen.provenance import commit, machine
from infinigen.storage import row_bytes
from infinigen.validation import parse_size

# Every policy but an upper bound (whose memory and speed mean nothing), in `POLICIES`' order.
DEFAULT_POLICIES = tuple(name for name, spec in POLICIES.items() if not spec.bound)


def fits(cfg, session, adapter, batch: int, positions: int, dtype) -> tuple[bool, str, dict]:
    """Whether `batch` x `positions` fits `cfg.compute_memory`: (fits, why not, the plan's parts)."""
    request = Request(batch, positions)
    try:
        planned = plan(cfg, adapter, session.selector_for, request, dtype)
    except MemoryBudgetError as exc:
        return False, str(exc), {}
    parts = dict(planned.parts)
    if cfg.spec.fmt == "int4":  # the quantized KV itself stays with the compute
        parts["quantized_kv"] = (
            batch
            * positions
            * adapter.num_kv_heads
            * len(adapter.global_layers)
            * row_bytes("int4", adapter.head_dim, torch.float16)
        )
        if sum(parts.values()) > planned.budget:
            return False, f"its int4 KV alone is {format_bytes(parts['quantized_kv'])}", parts
    return True, "", {**parts, "changes": list(planned.changes), "config": planned.config}


def largest_batch(cfg, session, adapter, positions: int, most: int, dtype) -> tuple[int, str, dict]:
    """The largest batch in [1, most] that fits (binary search: the bytes grow with the batch);
    0 and the reason when even one sequence does not."""
    ok, why, parts = fits(cfg, session, adapter, 1, positions, dtype)
    if not ok:
        return 0, why, {}
    low, high, best = 1, most, parts
    while low < high:
        mid = (low + high + 1) // 2
        ok, _, parts = fits(cfg, session, adapter, mid, positions, dtype)
        if ok:
            low, best = mid, parts
        else:
            high = mid - 1
    return low, "", best


def run(args: argparse.Namespace) -> int:
    from infinigen.api import attach
    from infinigen.loading import load_model

    budget = args.memory
    policies = args.policies.split(",")
    base = run_settings(args)
    # Within a memory budget dense holds most in the run's storage dtype (16 bits), not as computed.
    configs = [
        (p, (cfg.replace(kv_dtype=base.kv_dtype) if p == "dense" else cfg).replace(compute_memory=str(budget)))
        for p, cfg in policy_configs(args, policies)
    ]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(args.model, progress=True)
    dtype = next(model.parameters()).dtype
    weights = sum(p.nbytes for p in model.parameters())
    positions = args.context + args.steps + 1
    rows = []
    for p, cfg in configs:
        with attach(model, cfg, tokenizer=tok) as session:
            batch, why, parts = largest_batch(cfg, session, session.adapter, positions, args.max_batch, dtype)
            dense_kv = dense_kv_bytes(session.adapter, max(batch, 1), positions, cfg.storage_dtype() or dtype)
        planned = parts.pop("config", cfg)
        rows.append({
            "policy": p, "batch": batch, "context": args.context, "max_tokens": batch * args.context,
            "fits": True if batch else why, "planned_bytes": {k: v for k, v in parts.items() if k != "changes"},
            "planned_changes": parts.get("changes", []), "config": planned.to_dict() if batch else cfg.to_dict(),
            "dense_kv_bytes_at_batch": dense_kv,
        })  # fmt: skip
        print(f"{p:>10}: {'batch ' + str(batch) if batch else 'does not fit: ' + why}", flush=True)
    if args.run:
        _measure(args, model, tok, rows)
    dense_tokens = next((r["max_tokens"] for r in rows if r["policy"] == "dense"), None)
    full = next((r for r in rows if r["policy"] == "full" and r.get("tokens_per_s")), None)
    for r in rows:
        r["x_dense_capacity"] = r["max_tokens"] / dense_tokens if dense_tokens else None
        if full and r.get("tokens_per_s"):
            r["x_full_tokens_per_s"] = r["tokens_per_s"] / full["tokens_per_s"]
        if r.get("peak_rss_bytes"):
            r["peak_rss_over_weights_and_budget_bytes"] = r["peak_rss_bytes"] - weights - budget
    table = _table(rows, budget)
    note = (
        f"--memory {format_bytes(budget)} of KV-related bytes with the compute (weights apart: {format_bytes(weights)}); "
        f"context {args.context}, {args.steps} decode steps at each policy's largest batch, tier {configs[0][1].tier} "
        "(int4 keeps its packed KV with the compute and counts it). 'max tokens' = batch x context planned within "
        "--memory (infinigen.budget.plan, what a cache does with compute_memory); 'kept': measured at the end of "
        "the run; 'RSS - weights - budget': the peak resident set beyond weights and budget (the runtime, "
        "activations and transient copies). Measured on this machine, not modelled."
    )
    print(table)
    print(note)
    meta = {
        "commit": commit(), "machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "settings": {"budget_bytes": budget, "context": args.context, "steps": args.steps, "policies": policies,
                     "max_batch": args.max_batch, "run": args.run, "torch_threads": torch.get_num_threads()},
        "weight_bytes": weights, "note": note,
    }  # fmt: skip
    (out_dir / "bench_capacity.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    (out_dir / "bench_capacity.txt").write_text(table + "\n" + note + "\n")
    print(f"wrote {out_dir / 'bench_capacity.json'} and bench_capacity.txt")
    return 0


def _measure(args, model, tok, rows: list[dict]) -> None:
    """Decode at each policy's largest batch (a child process each, as `bench decode`)."""
    from tqdm.auto import tqdm

    from infinigen.config import InfiniGenConfig

    runnable = [r for r in rows if r["batch"]]
    bar = tqdm(total=len(runnable), desc="bench capacity", unit="run")
    base = run_settings(args)  # every row stores its KV in the run's dtype
    with tempfile.TemporaryDirectory(prefix="infinigen-capacity-") as tmp:
        kv_file = Path(tmp) / "prefill.safetensors"
        watched = any(InfiniGenConfig.from_dict(r["config"]).watches_prefill for r in runnable)
        save_prefill(model, _prompt_ids(tok, args.context), kv_file, base.storage_dtype() or torch.float32, watched)
        for r in runnable:
            cfg = InfiniGenConfig.from_dict(r["config"])
            bar.set_postfix_str(f"{r['policy']} B={r['batch']}")
            m = _run_child(args, kv_file, cfg, r["policy"], r["batch"], bar, base.kv_dtype)
            r.update({
                "tokens_per_s": m["tokens_per_s"], "peak_rss_bytes": m["peak_rss_bytes"],
                "rss_over_model_bytes": m["rss_over_model_bytes"], "compute_kv_bytes": m["compute_kv_bytes"],
                "compute_parts": m["compute_parts"], "tier_kv_bytes": m["tier_kv_bytes"],
                "bytes_read_per_token": m["bytes_read_per_token"], "fetched_fraction": m["fetched_fraction"],
            })  # fmt: skip
            if (
                POLICIES[r["policy"]].fmt == "int4"
            ):  # its packed KV (the "tier", host RAM) is the KV kept with the compute
                r["compute_parts"] = {**r["compute_parts"], "quantized_kv": m["tier_kv_bytes"]}
                r["compute_kv_bytes"] += m["tier_kv_bytes"]
            bar.update(1)
    bar.close()


def _table(rows: list[dict], budget: int) -> str:
    head = (
        f"{'policy':>10} {'batch':>5} {'max tokens':>10} {'x dense':>7} {'tok/s':>8} {'x full':>6} {'MiB read/tok':>12} "
        f"{'kept MiB':>9} {'planned MiB':>11} {'peak RSS':>9} {'RSS-w-budget':>12}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        if not r["batch"]:
            out.append(f"{r['policy']:>10}  does not fit: {r['fits']}")
            continue
        planned = sum(v for v in r["planned_bytes"].values()) / 2**20
        num = functools.partial(_num, r)
        out.append(
            f"{r['policy']:>10} {r['batch']:>5} {r['max_tokens']:>10} {num('x_dense_capacity'):>7} "
            f"{num('tokens_per_s'):>8} {num('x_full_tokens_per_s'):>6} {num('bytes_read_per_token', 2**20):>12} "
            f"{num('compute_kv_bytes', 2**20, '.1f'):>9} {planned:>11.1f} {num('peak_rss_bytes', 2**20, '.0f'):>8}M "
            f"{num('peak_rss_over_weights_and_budget_bytes', 2**20, '.0f'):>11}M"
        )
    return "\n".join(out)


def _num(row: dict, key: str, scale: float = 1.0, fmt: str = ".2f") -> str:
    return "-" if row.get(key) is None else format(row[key] / scale, fmt)


def memory_size(text: str) -> int:
    """--memory in bytes, refused here in its own name (not as the `compute_memory` it becomes)."""
    try:
        size = parse_size(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size: give one such as 512MiB or 1GiB")
    return size


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="infinigen bench capacity", description=__doc__)
    ap.add_argument(
        "--model", default=None, help="as for generate: smollm2 (default), gemma3-270m, a folder or a .gguf"
    )
    ap.add_argument("--device", default="cpu", help="where the model computes")
    ap.add_argument(
        "--memory",
        type=memory_size,
        default="1GiB",
        metavar="SIZE",
        help="KV-related bytes allowed with the compute (the compute_memory of every run), e.g. 512MiB, 1GiB",
    )
    ap.add_argument("--context", type=int, default=8000, help="context length in tokens")
    ap.add_argument("--max-batch", type=int, default=256, help="the largest batch considered")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    ap.add_argument("--steps", type=int, default=4, help="decode steps timed at each policy's largest batch")
    ap.add_argument("--profile", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--run", action=argparse.BooleanOptionalAction, default=True,
                    help="decode at each largest batch (--no-run: the plan alone)")  # fmt: skip
    ap.add_argument("--out", default="results/bench_capacity", help="folder for bench_capacity.json and .txt")
    # --memory sets every run's compute_memory; --budget is the fetch fraction, as in every command
    add_arguments(ap, DISK_DEFAULTS, skip=("policy", "compute_memory"))
    return ap


if __name__ == "__main__":
    raise SystemExit(run(build_parser().parse_args()))
