"""This machine as a `Hardware` of the cost model, from measurements (not spec sheets).

Microbenchmarks give the rates: a matrix-vector product over a 64 MiB fp32 matrix (the memory
bandwidth a decode step's linear layers see), a 1024³ fp32 matmul (FLOP/s), each with every
intra-op thread and with one fewer (what an offloading policy leaves the compute); O_DIRECT reads
of the disk tier, every region whole (a full fetch) and 5 % of each region's positions at random
(a selected fetch). The fixed per-layer cost of each policy (interpreter, hooks,
small ops) is measured by `bench decode` at a 64-token context, where bandwidth terms vanish.
The disk is measured through the disk tier itself (its reads, its request merging and AIO).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from infinigen.bench.costmodel import Hardware, ModelShape, Workload, predict


def _timed(fn, repeat: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def compute_rates(threads: int) -> tuple[float, float]:
    """(bytes/s of a fp32 gemv over 64 MiB, FLOP/s of a 1024³ fp32 matmul) with `threads`."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = torch.randn(4096, 4096)
        x = torch.randn(4096)
        gemv = _timed(lambda: torch.mv(w, x), 30)
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        mm = _timed(lambda: torch.mm(a, b), 10)
    finally:
        torch.set_num_threads(before)
    return w.numel() * 4 / gemv, 2 * 1024**3 / mm


def disk_rates(directory: str | None = None, heads: int = 16, positions: int = 32768) -> tuple[float, float]:
    """(sequential, scattered) bytes/s of the disk tier itself, O_DIRECT, no RAM block cache: a
    full read of every region (what full fetch does), and gathers of 5 % of the positions of
    each region at random (what a selection does; bytes counted as the tier counts them, whole
    blocks included). The scratch file is 2 · heads · positions · 128 B (128 MiB by default)."""
    from infinigen.storage import Storage

    storage = Storage("disk", "native", torch.float16, capacity=positions, layers=1, directory=directory)
    tier = storage.new_tier(1, heads, 64, torch.float16, positions=positions)
    try:
        g = torch.Generator().manual_seed(0)
        for _ in range(0, positions, 4096):
            rows = torch.randn(1, heads, 4096, 64, generator=g)
            tier.append(rows, rows)
        tier.read_all(positions, "cpu", torch.float32)  # warm the path, not the data: O_DIRECT
        stats = storage.stats
        stats.reset()
        t0 = time.perf_counter()
        for _ in range(2):
            tier.read_all(positions, "cpu", torch.float32)
        seq = (stats.bytes - stats.cached_bytes) / (time.perf_counter() - t0)
        stats.reset()
        n = positions // 20
        t0 = time.perf_counter()
        for _ in range(8):
            idx = torch.stack([torch.randperm(positions, generator=g)[:n].sort().values for _ in range(heads)])[None]
            tier.gather(idx, torch.ones_like(idx, dtype=torch.bool), "cpu", torch.float32)
        scattered = (stats.bytes - stats.cached_bytes) / (time.perf_counter() - t0)
    finally:
        tier.close()
        storage.close()
    return seq, scattered


def measure_overheads(model: str | None, out: Path, policies=("dense", "full", "infinigen")) -> list[dict]:
    """`bench decode` rows at a 64-token context (its own processes, its own JSON)."""
    cmd = [sys.executable, "-m", "infinigen.cli", "bench", "decode", "--contexts", "64", "--batches", "1,4",
           "--steps", "24", "--policies", ",".join(policies), "--out", str(out)]  # fmt: skip
    if model:
        cmd += ["--model", model]
    subprocess.run(cmd, check=True)
    return json.loads((out / "bench_decode.json").read_text())["rows"]


def this_machine(shape: ModelShape, small_rows: list[dict], directory: str | None = None) -> tuple[Hardware, dict]:
    """The calibrated `Hardware` "this-cpu" and the raw measurements behind it."""
    threads = torch.get_num_threads()
    bw, flops = compute_rates(threads)
    bw1, flops1 = compute_rates(max(1, threads - 1))
    seq, rnd = disk_rates(directory)
    raw = {
        "threads": threads,
        "gemv_bytes_per_s": bw,
        "matmul_flops": flops,
        "gemv_bytes_per_s_offload": bw1,
        "matmul_flops_offload": flops1,
        "disk_sequential_bytes_per_s": seq,
        "disk_scattered_5pct_bytes_per_s": rnd,
    }
    hw = Hardware(
        "this-cpu", f"this machine ({threads} threads), KV on its disk (O_DIRECT)", flops, bw, None, seq, rnd,
        kv_compute_bytes=4, spec_on_compute=False, offload_flops=flops1, offload_mem_bw=bw1,
        source="measured: " + ", ".join(f"{k}={v:.3g}" for k, v in raw.items()),
    )  # fmt: skip
    # Fixed per-layer costs: what a 64-token step spends beyond the bandwidth terms.
    overhead: dict[str, float] = {}
    work = Workload(fraction=1.0)
    # Fixed cost per layer and step, and its growth per extra batch row (per-row small ops), from
    # the 64-token rows at batch 1 and 4.
    spare: dict[tuple[str, int], float] = {}
    for row in small_rows:
        policy, b = row["policy"], row["batch"]
        if policy not in ("dense", "full", "infinigen"):
            continue
        bare = predict(replace(hw, overhead_s={}), shape, policy, row["context"], b, work)
        spare[policy, b] = max(0.0, row["step_ms_median"] / 1000 - bare.step_ms / 1000) / shape.layers
        if policy == "infinigen" and b == 1:
            overhead["speculation"] = row["speculation_ms_per_step"] / 1000 / (shape.layers - 2)
    for (policy, b), sec in spare.items():
        if b == 1:
            overhead[policy] = sec
            if (policy, 4) in spare:
                overhead[f"{policy}/row"] = max(0.0, (spare[policy, 4] - sec) / 3)
    raw["overhead_s_per_layer"] = overhead
    return replace(hw, overhead_s=overhead), raw


def workload_from_row(row: dict, shape: ModelShape) -> Workload:
    """InfiniGen's measured fetch at one (context, batch): the fraction selected and the bytes
    the tier read per byte of rows asked for (block amplification minus the RAM cache)."""
    cfg = row.get("config") or {}
    dense_layers = cfg.get("dense_layers", 2)
    fraction = row["fetched_fraction"] or 0.0
    useful = fraction * row["context"] * shape.kv_row_bytes(2) * (shape.layers - dense_layers)
    ampl = row["bytes_read_per_token"] / useful if useful else 1.0
    return Workload(
        fraction=fraction, amplification=ampl, dense_layers=dense_layers,
        partial_ratio=cfg.get("partial_ratio", 0.3),
        source=f"bench decode row (context {row['context']}, batch {row['batch']})",
    )  # fmt: skip
