"""`infinigen bench decode`: decode throughput and bytes moved, every policy side by side.

For each context length the prompt (real prose) is prefilled once with the unmodified model and
its KV saved; each (policy, batch) then runs in its own process — so that its peak RSS is its
own — which streams that KV into the policy's tier exactly as a prefill would, and times
`steps` greedy decode steps. A policy that watches its prefill (H2O) is also handed the prompt's
attention column sums, computed once beside the KV. Ratios are taken between rows of the same run.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import io
import json
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from infinigen.cli_settings import DISK_DEFAULTS, add_arguments, from_arguments
from infinigen.compat import cache_kwargs
from infinigen.config import AUTO_SHARE, POLICIES, InfiniGenConfig
from infinigen.figures import pyplot
from infinigen.memory import dense_kv_bytes
from infinigen.provenance import commit, machine

DEFAULT_POLICIES = ("dense", "dense-hf", "full", "infinigen")


# ---------------------------------------------------------------------- prefill (parent)
@torch.no_grad()
def save_prefill(model, ids: torch.Tensor, path: Path, kv_dtype: torch.dtype, column_sums: bool = False) -> None:
    """Prefill `ids` [1, T] with the plain model (in chunks); save every layer's KV (a
    sliding-window layer's: its window), the context and the next token; with `column_sums`,
    also the prompt's attention column sums per global layer, which a policy that watches its
    prefill (H2O) is handed at the replay as its own prefill would accumulate them."""
    from safetensors.torch import save_file

    from infinigen.generation import prompt_column_sums
    from infinigen.prefill import dense_prefix

    prefix = dense_prefix(model, ids)
    tensors = {"next_token": prefix.next_token, "context": torch.tensor(prefix.length)}
    for i, (k, v) in enumerate(prefix.layers):
        tensors[f"layer.{i}.k"] = k.to(kv_dtype).contiguous()
        tensors[f"layer.{i}.v"] = v.to(kv_dtype).contiguous()
    if column_sums:
        for i, sums in prompt_column_sums(model, ids).items():
            tensors[f"layer.{i}.sums"] = sums.contiguous()
    save_file(tensors, str(path))


def _release_free_heap() -> None:
    """Hand freed heap back to the OS (glibc keeps it otherwise), so that resident-set figures
    count what is held, not what was once allocated (the prefill's replay, the loader's copies)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> None:
    _release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the peak resident set size (VmHWM)
    except OSError:
        pass


def _peak_rss() -> int:
    """VmHWM in bytes (falls back to ru_maxrss where /proc is absent)."""
    return _status_bytes("VmHWM:")


def _rss() -> int:
    """VmRSS in bytes now (the peak where /proc is absent)."""
    return _status_bytes("VmRSS:")


def _status_bytes(field: str) -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------- one configuration (child)
HF_DENSE = "dense-hf"  # the unmodified model with transformers' DynamicCache: a second dense reference
ROW_NAMES = (HF_DENSE,)


class _HFDense:
    """The unmodified model and transformers' own growing cache, timed like the policies."""

    def __init__(self, model) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=model.config)

    def update(self, k, v, i) -> None:
        self.cache.update(k, v, i)

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def summary(self) -> dict:
        parts = {"dense_layers": 0, "local_layers": 0}  # what its layers hold, as computed
        for layer in self.cache.layers:
            part = "local_layers" if getattr(layer, "is_sliding", False) else "dense_layers"
            parts[part] += sum(t.nbytes for t in (layer.keys, layer.values) if t is not None)
        held = sum(parts.values())
        return {"memory": {"compute_kv_bytes": held, "compute_parts": parts, "tier_kv_bytes": 0},
                "bytes_fetched": 0, "bytes_cached": 0, "read_amplification": None, "fetched_fraction": None,
                "speculation_seconds": 0.0, "wait_seconds": 0.0, "correction_seconds": 0.0, "correction_bytes": 0,
                "per_layer": [], "reads": 0}  # fmt: skip


@torch.no_grad()
def run_child(args: argparse.Namespace) -> dict:
    import contextlib

    from safetensors import safe_open

    from infinigen.api import attach
    from infinigen.loading import load_model
    from infinigen.models import get_adapter
    from infinigen.prefill import Prefix

    cfg = InfiniGenConfig.from_dict(json.loads(args.config_json))
    if args.row == HF_DENSE and cfg.compute_threads:
        torch.set_num_threads(cfg.compute_threads)  # the other rows get theirs from attach
    hf_dense = args.row == HF_DENSE
    model, tok = load_model(args.model, progress=False)
    device = torch.device(args.device)
    model.to(device)
    gc.collect()
    _release_free_heap()
    rss_model = _rss()  # the weights and the runtime, before any KV (not the loader's transient peak)
    adapter = get_adapter(model)
    b = args.batch
    with safe_open(args.kv_file, framework="pt") as f:
        context = int(f.get_tensor("context"))
    with contextlib.ExitStack() as stack:
        if hf_dense:
            cache = _HFDense(model)
        else:
            session = stack.enter_context(attach(model, cfg, tokenizer=tok, progress=False))
            cache = stack.enter_context(session.new_cache(max_length=context + args.steps + 1, batch=b))
        with safe_open(args.kv_file, framework="pt") as f:
            nxt = f.get_tensor("next_token").expand(b)[:, None].contiguous().to(device)
            # Stream the saved prefill into the cache layer by layer, as a prefill would.
            layers = [(f.get_tensor(f"layer.{i}.k"), f.get_tensor(f"layer.{i}.v")) for i in range(adapter.num_layers)]
            prefix = Prefix([(k.to(device), v.to(device)) for k, v in layers], context, nxt, 0.0)
            if cfg.watches_prefill:
                # copies: a tensor read from the file maps all of it, which would stay resident with it
                saved = set(f.keys())
                prefix.column_sums = {
                    i: f.get_tensor(f"layer.{i}.sums").to(device, copy=True)
                    for i in range(adapter.num_layers)
                    if f"layer.{i}.sums" in saved
                }
                if not prefix.column_sums:
                    raise SystemExit(f"policy {cfg.policy} watches the prefill: the saved prefill has no column sums")
            prefix.replay(cache, b)
            del layers, prefix
        past = cache.cache if hf_dense else cache
        # Peak RSS of the decode phase itself: reset the high-water mark after the replay (which
        # maps the saved prefill file) so that only what the policy keeps while decoding counts.
        gc.collect()
        _reset_peak_rss()
        if not hf_dense:
            cache.storage.stats.reset()
            cache.counters.speculation_seconds = cache.counters.wait_seconds = 0.0
        step_times = []
        tokens = nxt
        profiler = cProfile.Profile() if args.profile else None
        for _ in range(args.steps):
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            out = model(input_ids=tokens, **cache_kwargs(model, past), use_cache=True)
            tokens = out.logits[:, -1].argmax(-1, keepdim=True)
            if profiler is not None:
                profiler.disable()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # timing only: a step ends when its kernels have run
            step_times.append(time.perf_counter() - t0)
        s = cache.summary()
        reads = 0 if hf_dense else cache.storage.stats.reads
        peak = _peak_rss()
    warm = step_times[1:] if len(step_times) > 1 else step_times  # the first step warms caches
    decode = sum(warm)
    steps = len(step_times)
    itemsize = torch.empty((), dtype=cfg.storage_dtype() or torch.float32).element_size()
    # the run's KV storage dtype: every row's share is of dense's KV in it, dense's own included
    reference = getattr(torch, args.kv_reference) if args.kv_reference not in (None, "None") else torch.float32
    global_layers = len(adapter.global_layers)  # local (sliding-window) layers hold only their window
    kv_bytes = global_layers * 2 * b * adapter.num_kv_heads * context * adapter.head_dim * itemsize
    local_bytes = s["memory"]["compute_parts"]["local_layers"]  # the sliding-window layers, as each cache counts
    dense = hf_dense or cfg.spec.placement == "compute"
    tokens_total = steps * b
    return {
        "policy": args.row or cfg.policy,
        "context": context,
        "batch": b,
        "steps": steps,
        "tokens_per_s": len(warm) * b / decode if decode > 0 else float("nan"),
        "step_ms_median": 1000 * sorted(warm)[len(warm) // 2],
        "bytes_read_per_token": s["bytes_fetched"] / tokens_total if not dense else 0.0,
        "bytes_from_ram_per_token": s["bytes_cached"] / tokens_total if not dense else 0.0,
        "reads_per_token": reads / tokens_total,
        "read_amplification": s["read_amplification"] if not dense else None,
        "fetched_fraction": s["fetched_fraction"],
        "speculation_ms_per_step": 1000 * s["speculation_seconds"] / steps,
        "speculation_pct": 100 * s["speculation_seconds"] / sum(step_times) if step_times else 0.0,
        # the correction's top-ups: chosen from the layer's own query, then read (the compute waits on both)
        "correction_ms_per_step": 1000 * s["correction_seconds"] / steps,
        "correction_pct": 100 * s["correction_seconds"] / sum(step_times) if step_times else 0.0,
        "correction_bytes_per_token": s["correction_bytes"] / tokens_total if not dense else 0.0,
        "wait_ms_per_step": 1000 * s["wait_seconds"] / steps,
        # every step, the first included, as the waits and the transfers are counted
        "step_ms_mean": 1000 * sum(step_times) / steps,
        # the time the tier spent delivering rows (reads and unpacking, beside the compute)
        "transfer_ms_per_step": 0.0 if hf_dense else 1000 * cache.storage.stats.seconds / steps,
        "wait_pct": 100 * s["wait_seconds"] / sum(step_times) if step_times else 0.0,
        "wait_ms_per_layer": [1000 * p["wait_seconds"] / steps for p in s["per_layer"]],
        "peak_rss_bytes": peak,
        "rss_after_model_bytes": rss_model,
        "rss_over_model_bytes": peak - rss_model,  # to hold against compute_kv_bytes (+ tier_kv_bytes for ram)
        "kv_cache_bytes": kv_bytes,
        "local_kv_bytes": local_bytes,
        "selector_bytes": 0 if dense else s.get("selector_bytes", 0),
        # What the policy keeps with the compute at the end, by part (infinigen.memory), against
        # dense's KV for the same batch and positions in the KV's storage dtype.
        "compute_kv_bytes": s["memory"]["compute_kv_bytes"],
        "compute_parts": s["memory"]["compute_parts"],
        "tier_kv_bytes": s["memory"]["tier_kv_bytes"],
        "dense_kv_bytes": dense_kv_bytes(adapter, b, context + steps, reference),
        "layers_offloaded": 0 if dense else global_layers,
        "tier": "compute" if dense else cfg.tier,
        "config": None if hf_dense else cache.config.to_dict(),  # as the cache resolved it (its unit)
        "plan": s.get("plan"),  # within compute_memory: the budget in bytes and what the cache gave up for it
        "profile": _profile_top(profiler, args.profile) if profiler is not None else None,
    }


def _profile_top(profiler: cProfile.Profile, lines: int) -> str:
    """The top `lines` functions of a decode profile by their own time (the compute thread only)."""
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.sort_stats("tottime").print_stats(lines)
    text = buf.getvalue()
    start = text.find("ncalls")
    return text[start:].rstrip() if start >= 0 else text.rstrip()


# ---------------------------------------------------------------------- parent
def _prompt_ids(tok, context: int) -> torch.Tensor:
    from infinigen.skew import calibration_text

    ids = tok(calibration_text(), return_tensors="pt").input_ids[0]
    if ids.numel() < context:
        ids = ids.repeat(context // ids.numel() + 1)
    return ids[:context][None]


def _fmt_table(rows: list[dict]) -> str:
    head = (
        f"{'policy':>10} {'ctx':>5} {'B':>2} {'tok/s':>8} {'x full':>7} {'x dense':>8} {'tier MiB':>8} {'cache MiB':>9} "
        f"{'reads':>6} {'ampl':>5} {'fetched':>8} {'spec ms':>8} {'wait %':>7} {'floors ms':>11} {'eff':>5} "
        f"{'peak RSS':>9} {'local KV':>9} "
        f"{'selector':>9} {'with compute':>12} {'% dense KV':>10}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        amp = "-" if r["read_amplification"] is None else f"{r['read_amplification']:.2f}"
        frac = "-" if r["fetched_fraction"] is None else f"{100 * r['fetched_fraction']:.1f}%"
        disk = (r["bytes_read_per_token"] - r["bytes_from_ram_per_token"]) / 2**20
        read = "-" if r.get("read_floor_ms") is None else f"{r['read_floor_ms']:.0f}"
        floors = f"{read}/{r['compute_floor_ms']:.0f}" if "compute_floor_ms" in r else "-"
        eff = "-" if r.get("efficiency") is None else f"{r['efficiency']:.2f}"
        out.append(
            f"{r['policy']:>10} {r['context']:>5} {r['batch']:>2} {r['tokens_per_s']:>8.2f} "
            f"{r.get('x_full', float('nan')):>7.2f} {r.get('x_dense', float('nan')):>8.2f} "
            f"{disk:>8.2f} {r['bytes_from_ram_per_token'] / 2**20:>9.2f} {r['reads_per_token']:>6.0f} {amp:>5} "
            f"{frac:>8} {r['speculation_ms_per_step']:>8.1f} {r['wait_pct']:>7.1f} {floors:>11} {eff:>5} "
            f"{r['peak_rss_bytes'] / 2**20:>7.0f}Mi "
            f"{r.get('local_kv_bytes', 0) / 2**20:>7.1f}Mi {r.get('selector_bytes', 0) / 2**20:>7.1f}Mi "
            f"{r['compute_kv_bytes'] / 2**20:>10.1f}Mi {100 * r['compute_kv_bytes'] / r['dense_kv_bytes']:>9.1f}%"
        )
    return "\n".join(out)


def _plot(rows: list[dict], path: Path) -> bool:
    """The run as a figure: with one context and several batch sizes, tokens/s and the KV kept
    with the compute against the batch (`_plot_batches`); otherwise, per batch size, tokens/s
    and the decode phase's peak RSS against the context (`_plot_contexts`)."""
    plt = pyplot()
    if plt is None:
        return False
    if len({r["context"] for r in rows}) == 1 and len({r["batch"] for r in rows}) > 1:
        fig = _plot_batches(plt, rows)
    else:
        fig = _plot_contexts(plt, rows)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _draw(speed, memory, rows: list[dict], x: str, kept: str, scale: str, scale_label: str) -> None:
    """One line per policy of tokens/s (on `speed`) and of the bytes `kept` (on `memory`) against
    the row key `x`, and dense's KV (the row key `scale`) dashed for scale."""
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r[x], r["tokens_per_s"], r[kept]) for r in rows if r["policy"] == policy)
        xs = [p[0] for p in pts]
        speed.plot(xs, [p[1] for p in pts], marker="o", label=policy)
        memory.plot(xs, [p[2] / 2**20 for p in pts], marker="o", label=policy)
    kv = sorted({(r[x], r[scale]) for r in rows})
    memory.plot([v for v, _ in kv], [k / 2**20 for _, k in kv], ls="--", color="gray", label=scale_label)


def _plot_batches(plt, rows: list[dict]):
    """Decode tokens/s and the KV-related bytes kept with the compute against the batch size,
    one line per policy, with dense's fp16 KV for scale: speed and memory side by side."""
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    _draw(speed, memory, rows, "batch", "compute_kv_bytes", "dense_kv_bytes", "dense's fp16 KV")
    speed.set_ylabel("decode tokens/s (all rows)")
    memory.set_ylabel("KV-related MiB kept with the compute")
    memory.set_yscale("log")
    batches = sorted({r["batch"] for r in rows})
    for ax in (speed, memory):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"decode at {rows[0]['context']} tokens: speed and memory kept with the compute (measured)")
    return fig


def _plot_contexts(plt, rows: list[dict]):
    """Per batch size, decode tokens/s and the decode phase's peak RSS (model weights included)
    against the context, one line per policy, with dense's KV size for scale."""
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(batches), 2, figsize=(11, 4 * len(batches)), squeeze=False)
    for (speed, memory), b in zip(axes, batches):
        here = [r for r in rows if r["batch"] == b]
        _draw(speed, memory, here, "context", "peak_rss_bytes", "kv_cache_bytes", "dense's KV alone")
        speed.set_ylabel("decode tokens/s")
        memory.set_ylabel("peak RSS while decoding (MiB, weights included)")
        for ax in (speed, memory):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_title(f"batch {b}")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle("decode speed and memory against context (measured on this machine)")
    return fig


def run_settings(args: argparse.Namespace) -> InfiniGenConfig:
    """The run's settings from the flags (the KV on disk, stored in 16 bits, unless they say
    otherwise): what every row starts from."""
    return from_arguments(args, DISK_DEFAULTS, policy="infinigen")


def policy_configs(args: argparse.Namespace, policies: list[str]) -> list[tuple[str, InfiniGenConfig]]:
    """(row name, config) per policy from the flags. A policy whose storage format the chosen
    tier cannot hold (int4 keeps its packed KV in host RAM) runs on the RAM tier, and its row
    says so; `dense-hf` is the unmodified model with transformers' DynamicCache."""
    from infinigen.storage import check_combination

    unknown = [p for p in policies if p not in POLICIES and p not in ROW_NAMES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; available: {', '.join([*POLICIES, *ROW_NAMES])}")
    base = run_settings(args)
    out = []
    for p in policies:
        if p == HF_DENSE:
            out.append((p, base.replace(policy="dense")))
            continue
        if p == "dense":  # the fastest dense: its KV as computed, preallocated
            out.append((p, base.speed_reference()))
            continue
        tier = base.tier
        try:
            check_combination(tier, POLICIES[p].fmt)
        except ValueError:
            tier = "ram"
        out.append((p, base.replace(policy=p, tier=tier)))
    return out


def _run_child(
    args: argparse.Namespace, kv_file: Path, cfg: InfiniGenConfig, row: str, batch: int, bar, reference: str | None
) -> dict:
    """One (policy, context, batch) run in its own process, so that its peak RSS is its own."""
    cmd = [
        sys.executable, "-m", "infinigen.bench.decode", "--child",
        "--kv-file", str(kv_file), "--config-json", json.dumps(cfg.to_dict()), "--batch", str(batch),
        "--steps", str(args.steps), "--profile", str(args.profile), "--row", row,
        "--kv-reference", str(reference),
    ]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    cmd += ["--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        bar.close()
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"benchmark child failed for policy={row} batch={batch}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def add_floors(row: dict, full: dict | None) -> None:
    """A row's bounds (`docs/usage.md`): its compute floor, the step with its waits and its
    correction taken out (transfers free); its read floor, its bytes from the tier at the rate
    full fetch read them in the same run (`full`: full fetch's row of the same context and
    batch; None: unknown); and its efficiency, the larger floor over its step."""
    step = row["step_ms_mean"]
    row["compute_floor_ms"] = max(step - row["wait_ms_per_step"] - row["correction_ms_per_step"], 0.0)
    row["read_floor_ms"] = None
    if full is not None and full["transfer_ms_per_step"] > 0:
        rate = _tier_bytes_per_step(full) / full["transfer_ms_per_step"]  # bytes per ms
        row["read_floor_ms"] = _tier_bytes_per_step(row) / rate
    floor = max(row["compute_floor_ms"], row["read_floor_ms"] or 0.0)
    row["efficiency"] = floor / step if step > 0 else None


def _tier_bytes_per_step(row: dict) -> float:
    """Bytes a step read from the tier's medium (what came from RAM in front of it left out)."""
    return (row["bytes_read_per_token"] - row["bytes_from_ram_per_token"]) * row["batch"]


def _median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s, with every run's tokens/s alongside."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    return row


def run_parent(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from infinigen.api import attach
    from infinigen.loading import load_model

    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    policies = args.policies.split(",")
    if args.repeats < 1 or args.steps < 2:
        raise SystemExit("--repeats must be >= 1 and --steps >= 2 (the first step only warms up)")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this machine has no CUDA device (torch sees none)")
    configs = policy_configs(args, policies)  # invalid settings fail here, before any model work
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(args.model, progress=True)
    limit = model.config.max_position_embeddings
    too_long = [c for c in contexts if c + args.steps + 1 > limit]
    if too_long:
        raise SystemExit(f"contexts {too_long} + {args.steps} steps exceed the model's {limit} positions")
    for _, cfg in configs:
        if cfg.spec.selector == "infinigen":  # calibrate (and choose the spread) once, here: no child pays for it
            with attach(model, cfg, tokenizer=tok) as session:
                session.selector_for(cfg)
    rows: list[dict] = []
    base = run_settings(args)
    bar = tqdm(total=len(contexts) * len(batches) * len(configs) * args.repeats, desc="bench decode", unit="run")
    kv_dtype = base.storage_dtype() or torch.float32
    with tempfile.TemporaryDirectory(prefix="infinigen-bench-") as tmp:
        for c in contexts:
            kv_file = Path(tmp) / f"prefill-{c}.safetensors"
            bar.set_postfix_str(f"prefill {c}")
            save_prefill(model, _prompt_ids(tok, c), kv_file, kv_dtype, any(cfg.watches_prefill for _, cfg in configs))
            for b in batches:
                runs: dict[str, list[dict]] = {p: [] for p, _ in configs}
                for _ in range(args.repeats):  # rounds interleave the rows: drift hits every row alike
                    for p, cfg in configs:
                        bar.set_postfix_str(f"{p} ctx={c} B={b}")
                        runs[p].append(_run_child(args, kv_file, cfg, p, b, bar, base.kv_dtype))
                        bar.update(1)
                for p, _ in configs:
                    rows.append(_median_run(runs[p]))
                    r = rows[-1]
                    tqdm.write(
                        f"{p:>10} ctx={c:>5} B={b}: {r['tokens_per_s']:.2f} tok/s, "
                        f"{r['bytes_read_per_token'] / 2**20:.2f} MiB/token"
                    )
    bar.close()
    for r in rows:
        same = {q["policy"]: q for q in rows if q["context"] == r["context"] and q["batch"] == r["batch"]}
        add_floors(r, same.get("full"))
        if "full" in same:
            r["x_full"] = r["tokens_per_s"] / same["full"]["tokens_per_s"]
        dense = [same[p] for p in ("dense", HF_DENSE) if p in same]
        if dense:  # against the faster dense reference of this run
            best = max(dense, key=lambda q: q["tokens_per_s"])
            r["x_dense"] = r["tokens_per_s"] / best["tokens_per_s"]
            r["dense_reference"] = best["policy"]
            r["rss_saving_vs_dense_bytes"] = best["peak_rss_bytes"] - r["peak_rss_bytes"]
    table = _fmt_table(rows)
    if base.compute_memory is None:
        memory = "no compute_memory budget"
    elif base.aims:
        memory = (
            f"every offloading policy aiming at {AUTO_SHARE} of dense's KV with the compute (compute_memory auto: "
            "full fetch and the dense layers read in chunks, the sliding windows read back from the tier, where "
            "that needs it; --compute-memory none for none)"
        )
    else:
        memory = f"every offloading policy within compute_memory {base.compute_memory}"
    note = (
        f"tier={base.tier} (KV stored as {base.kv_dtype}; compute fp32 on CPU; block cache {base.block_cache} of each "
        f"layer's blocks; {memory}), {args.steps} decode steps after prefill, tok/s over steps 2..N"
        + (f", median of {args.repeats} interleaved runs" if args.repeats > 1 else "")
        + ". 'x dense': against the "
        "faster of dense (preallocated) and dense-hf (DynamicCache). Per token: 'tier MiB' read from the slow "
        "tier's medium (the disk; host RAM for the ram tier), read amplification included; 'cache MiB' served "
        "from RAM in front of the disk (unwritten tail blocks, block cache); 'reads' disk read requests. 'spec ms': selection time per step, on the prefetch thread; "
        "'wait %': share of the step the compute waited on transfers; 'floors ms': read/compute floor of a step (read: its tier bytes at the rate full fetch's transfers read in this run; compute: the step less its waits and its correction), 'eff': the larger floor over the mean step; 'local KV': what the sliding-window layers keep with the compute (0 where their windows are read back from the tier, each step's window then in the tier columns); 'selector': what the selection keeps with the compute (InfiniGen's partial keys in their `partial_format`, spare capacity included; Quest's page bounds; H2O's scores). Measured on this machine, not modelled."
    )
    print(table)
    print(note)
    for r in rows:
        if r.get("profile"):
            print(f"\nprofile of {r['policy']} ctx={r['context']} B={r['batch']} (decode steps, by own time):")
            print(r["profile"])
    meta = {
        "commit": commit(),
        "machine": machine(),
        "settings": {
            "contexts": contexts,
            "batches": batches,
            "policies": policies,
            "steps": args.steps,
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
            "configs": {p: cfg.to_dict() for p, cfg in configs},
        },
        "note": note,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (out_dir / "bench_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out_dir / "bench_decode.txt").write_text(table + "\n" + note + "\n")
    figure = " and bench_decode.png" if _plot(rows, out_dir / "bench_decode.png") else ""
    print(f"wrote {out_dir / 'bench_decode.json'}, bench_decode.txt{figure}")
    return 0


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="infinigen bench decode", description=__doc__)
    ap.add_argument(
        "--model", default=None, help="as for generate: smollm2 (default), gemma3-270m, a folder or a .gguf"
    )
    ap.add_argument("--device", default="cpu", help="where the model computes: cpu, or cuda for the pinned tier")
    ap.add_argument("--contexts", default="1024,2048,4096,8000", help="comma-separated context lengths")
    ap.add_argument("--batches", default="1,4", help="comma-separated batch sizes (the prompt repeated)")
    ap.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma list of {', '.join([*POLICIES, *ROW_NAMES])} ({HF_DENSE}: transformers' DynamicCache; "
        "int4 runs on the RAM tier)",
    )
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per run (after the prefill)")
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs per row, interleaved in rounds; the row shows the median"
    )
    ap.add_argument(
        "--out", default="results/bench", help="folder for bench_decode.json, .txt and .png (created if missing)"
    )
    ap.add_argument(
        "--profile", type=int, default=0, metavar="N", help="print the top N functions of a decode profile per run"
    )
    add_arguments(ap, DISK_DEFAULTS, skip=("policy",))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kv-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config-json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv-reference", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    return run_parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
