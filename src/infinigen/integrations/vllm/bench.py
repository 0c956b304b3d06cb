"""Benchmark (not a test): vLLM's own CPU backend against the plugin (full fetch, InfiniGen, and the
oracle as the quality bound), side by side in one run, each row in its own process. Prints a table
and writes JSON (commit, machine, settings, every step's time).

    python -m infinigen.integrations.vllm.bench --context 8000 --batches 1,8,16 --new 32

Fair by construction:
- every row is given the KV memory its largest batch needs (vLLM's own at its full page, the plugin
  at its own), and each batch reports how many requests decoded at once (a batch where fewer than B
  did is marked, never reported as B);
- decode is timed step by step through vLLM's engine (`LLMEngine.step`): only steps where every
  request of the batch had its first token before the step and gets one from it count, so prefill
  and its scheduling cannot leak in (vLLM's default prefill budget: long prompts prefill in chunks);
- vLLM's own runs eager and in its default compiled mode (row `vllm-compiled`); the plugin is
  compared against the faster;
- every row runs on the same cores with the same threads (`--threads`: vLLM's worker given all of
  them, OMP threads bound, none reserved; `--threads auto` leaves vLLM's own default, printed).

Per row and batch: decode tok/s (the median pure-decode step), prefill seconds, requests at once,
bytes read per step (weights, and the KV each row reads: vLLM's whole context; the plugin's codes,
selected rows and dense layers, from its counters), the step's byte floor at the memory read rate
measured in the same run, the efficiency (floor / step), peak RSS, greedy tokens equal to vLLM's own,
and the KL from vLLM's own distribution and from the plugin's full fetch, teacher forced to vLLM's
greedy tokens (full vocabulary, through a logits processor).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# row -> (INFINIGEN_VLLM, eager)
ROWS = {
    "vllm": (None, True),
    "vllm-compiled": (None, False),
    "full": ("policy=full", True),
    "infinigen": ("policy=infinigen", True),
    "oracle": ("policy=oracle", True),
}
GiB = 1 << 30


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
    ids = tok(Path(cfg["text"]).read_text())["input_ids"]
    ctx, new, batches = cfg["context"], cfg["new"], cfg["batches"]
    most = max(batches)
    stride = max(1, (len(ids) - ctx) // max(1, most - 1))
    prompts = [(ids * 2)[i * stride : i * stride + ctx] for i in range(most)]
    llm = LLM(
        model=cfg["model"], dtype=cfg["dtype"], enforce_eager=cfg["eager"], max_model_len=_model_len(ctx, new, batches, cfg["max_positions"]),
        max_num_seqs=max(most, 8), enable_prefix_caching=False, max_logprobs=-1, logits_processors=[ForceTokens],
        seed=0, disable_log_stats=True,
    )  # fmt: skip
    from infinigen.integrations.vllm import plugin

    engine = llm.llm_engine
    vc = engine.vllm_config
    block = vc.cache_config.block_size
    out = {"row": cfg["row"], "blocks": vc.cache_config.num_gpu_blocks, "block_size": block, "batches": {},
           "threads": torch.get_num_threads()}  # fmt: skip
    out["concurrent"] = out["blocks"] // -(-(ctx + new) // block)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:64])], SamplingParams(max_tokens=2), use_tqdm=False)
    rt = plugin.current()
    # batch 1 on its own (its prefill is a single prompt's), then the larger batches from one prefill
    rows = _decode_phases(engine, prompts, [1], new, rt, "one")
    if max(batches) > 1:
        rows |= _decode_phases(engine, prompts, [b for b in batches if b > 1], new, rt, "many")
    # the same batches over 64 positions: the step with (almost) no KV to read, this row's compute
    short = _decode_phases(engine, [p[:64] for p in prompts], batches, 8, rt, "short")
    for b in batches:
        rows[b]["short_step_s"] = short[b]["step_s"]
        out["batches"][str(b)] = rows[b]
    if cfg.get("force") is not None or cfg["row"] == "vllm":  # vLLM's own greedy run is its forced one
        force = cfg.get("force")
        forced = SamplingParams(temperature=0, max_tokens=len(force) if force else cfg.get("kl_tokens", 1 + new),
                                ignore_eos=True,
                                logprobs=-1, extra_args={"force": force} if force else None)  # fmt: skip
        res = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], forced, use_tqdm=False)[0].outputs[0]
        vocab = len(res.logprobs[0])
        dist = torch.full((len(res.logprobs), vocab), float("-inf"))
        for j, lp in enumerate(res.logprobs):
            idx = torch.tensor(list(lp.keys()))
            dist[j, idx] = torch.tensor([v.logprob for v in lp.values()])
        torch.save(dist.to(torch.float32), cfg["dist"])
        out["forced_tokens"] = list(res.token_ids)
    if rt is not None:
        out["runtime"] = rt.describe()
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(cfg["out"]).write_text(json.dumps(out))


def _decode_phases(engine, prompts: list[list[int]], batches: list[int], new: int, rt, tag: str) -> dict[int, dict]:
    """The largest batch's prompts added together and prefilled once (vLLM schedules them as it
    does, its default prefill budget included); then `new` decode steps at each batch, largest
    first, the requests past the next batch aborted between phases. Every step is timed; a phase
    counts only the steps where all of its requests had their first token before the step and got
    one from it. Returns {batch: measurements} (the prefill time is the largest batch's)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    order = sorted(set(batches), reverse=True)
    # room for every phase and for the tokens the first requests decode while the last still prefill
    # (vLLM chunks long prompts): none may finish before the phases end, which abort them all
    params = SamplingParams(temperature=0, max_tokens=_DECODE_ROOM, ignore_eos=True,
                            output_kind=RequestOutputKind.CUMULATIVE)  # fmt: skip
    names = [f"{tag}-{i}" for i in range(order[0])]
    t0 = time.perf_counter()
    for name, p in zip(names, prompts[: order[0]]):
        engine.add_request(name, TokensPrompt(prompt_token_ids=p), params)
    have = dict.fromkeys(names, 0)
    tokens: dict[str, list[int]] = {}

    def step() -> tuple[float, int]:
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        advanced = 0
        for o in outs:
            n = len(o.outputs[0].token_ids)
            advanced += n > have.get(o.request_id, n)
            have[o.request_id] = n
            tokens[o.request_id] = list(o.outputs[0].token_ids)
        return dt, advanced

    while not all(n > 0 for n in have.values()):
        step()
    prefill_s = time.perf_counter() - t0
    out: dict[int, dict] = {}
    for b in order:
        live = names[:b]
        gone = [n for n in have if n not in live]
        if gone:
            engine.abort_request(gone)
            for n in gone:
                have.pop(n)
        steps, at_once, counters = [], [], []
        for _ in range(new):
            before = _counters(rt)
            dt, advanced = step()
            steps.append(dt)
            at_once.append(advanced)
            if before is not None and advanced == b:
                after = _counters(rt)
                counters.append({k: after[k] - before[k] for k in after})
        full = [x for x, a in zip(steps, at_once) if a == b]
        row = {"steps_s": steps, "at_once": at_once, "prefill_s": prefill_s, "prefill_batch": order[0],
               "tokens": [list(tokens[n]) for n in live], "requests_at_once": max(at_once, default=0),
               "full_steps": len(full), "step_s": statistics.median(full) if full else float("nan")}  # fmt: skip
        row["tok_s"] = b / row["step_s"] if full else float("nan")
        if counters:
            row["bytes_read_per_step"] = statistics.median(c["bytes_read"] for c in counters)
            row["codes_read_per_step"] = statistics.median(c["codes_read"] for c in counters)
            attended, context = (sum(c[k] for c in counters) for k in ("rows_attended", "rows_context"))
            row["attended_share"] = attended / max(1, context)
        out[b] = row
    engine.abort_request(list(have))
    while engine.has_unfinished_requests():
        engine.step()
    return out


_DECODE_ROOM = 512  # tokens a request of a decode run may reach (its phases abort it before)


def _model_len(context: int, new: int, batches: list[int], most: int) -> int:
    """Positions a request reaches: its prompt and `_DECODE_ROOM` (every phase of `new` tokens, and
    what the first requests decode while the last still prefill), within the model's `most`."""
    want = context + max(_DECODE_ROOM, new * len(batches) + 16)
    if context + new * len(batches) + 16 > most:
        raise SystemExit(
            f"--context {context} leaves no room for {len(batches)} phases of {new} tokens in the model's {most}"
        )
    return min(want, most)


def _counters(rt) -> dict | None:
    if rt is None:
        return None
    c = rt.counters
    return {"bytes_read": rt.store.bytes_read, "codes_read": c.codes_read, "rows_attended": c.rows_attended,
            "rows_context": c.rows_context}  # fmt: skip


def _kl(p, q) -> float:
    """Mean over positions of KL(p || q) from log-probabilities [T, V]."""
    import torch

    pp = p.exp()
    return float(torch.where(pp > 0, pp * (p - q.clamp(min=-1e30)), torch.zeros_like(p)).sum(-1).mean())


def _shape(model: str, dtype: str) -> dict:
    """The model's weights and KV sizes, from its folder (config and safetensors headers)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model)
    itemsize = 4 if dtype == "float32" else 2
    params = 0
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = 1
                for s in st.get_slice(k).get_shape():
                    n *= s
                params += n
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    d = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return {"params": params, "weight_bytes": params * itemsize, "layers": hf.num_hidden_layers, "kv_heads": kv_heads,
            "heads": heads, "head_dim": d, "itemsize": itemsize,
            "max_positions": int(getattr(hf, "max_position_embeddings", 1 << 30)),
            "kv_bytes_per_token": 2 * hf.num_hidden_layers * kv_heads * d * itemsize}  # fmt: skip


def _memory_rate(threads: int) -> float:
    """Bytes per second this machine's cores read from memory (a sum over 1 GiB, best of five)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(GiB // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(old)
    return x.nbytes / best


def _selection_rates(shape: dict, context: int, batch: int, channels: int) -> dict[str, dict[str, float]]:
    """The selection kernel alone (`kernels.select_codes`, mass, 10 %), on random codes of the run's
    shape laid out as vLLM's pages: bytes of codes per second on one thread and on every core, on
    the portable path and on the best path this CPU has (best of seven runs each)."""
    import torch

    from infinigen import kernels
    from infinigen.integrations.vllm.runtime import PageCodes, page_bytes

    hkv, g = shape["kv_heads"], shape["heads"] // shape["kv_heads"]
    bs = 128
    nb = -(-context // bs)
    row = page_bytes(channels)
    gen = torch.Generator().manual_seed(0)
    page = torch.randint(0, 256, (batch * nb, hkv, bs, row), dtype=torch.uint8, generator=gen)
    flat = page.view(batch * nb, hkv, -1)
    pairs = (channels + 1) // 2
    scales = (torch.rand(batch * nb, hkv, bs, generator=gen) * 0.1 + 0.01).to(torch.float16)
    flat[:, :, pairs * bs : (pairs + 2) * bs] = scales.view(torch.uint8).view(batch * nb, hkv, -1)
    tables = torch.randperm(batch * nb, generator=gen).view(batch, nb).to(torch.int32).contiguous()
    codes = PageCodes(channels, bs).locate(page, tables)
    q = torch.randn(batch, hkv, g, 2 * pairs, generator=gen) * 0.1
    bias = torch.zeros(batch, hkv, g)
    lengths = torch.full((batch,), context)
    rule = kernels.Rule.of("mass", float("inf"), 0.1, None, 8)
    nbytes = batch * hkv * context * row
    out: dict[str, dict[str, float]] = {}
    for path in dict.fromkeys(["portable", kernels.best_isa()]):
        out[path] = {}
        for threads in dict.fromkeys([1, os.cpu_count() or 1]):
            best = float("inf")
            with kernels.isa_cap(path):
                for _ in range(7):
                    t0 = time.perf_counter()
                    kernels.select_codes(codes, lengths, q, bias, rule, threads_=threads)
                    best = min(best, time.perf_counter() - t0)
            out[path][f"{threads} threads"] = nbytes / best
    return out


def _row_memory(row: str, shape: dict, tokens: int, channels: int) -> int:
    """KV memory (GiB) that holds `tokens` positions for a row: vLLM's own page, or the plugin's."""
    from infinigen.integrations.vllm.runtime import page_bytes, placeholder_bytes

    setting = ROWS[row][0]
    if setting is None:
        per = shape["kv_bytes_per_token"]
    else:
        c = page_bytes(channels, shape["itemsize"]) if "infinigen" in setting else placeholder_bytes(shape["itemsize"])
        per = shape["layers"] * shape["kv_heads"] * c
    return max(1, math.ceil(tokens * per * 1.05 / GiB))  # vLLM takes whole GiB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M, converted once)")
    ap.add_argument("--text", default=None, help="prompt text (default: the package's essay)")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--kl-tokens", type=int, default=128, help="positions of the first prompt the KL is taken over")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--threads", default="all", help="all: vLLM's worker on every core, bound; auto: vLLM's default")
    ap.add_argument("--json", default="vllm-bench.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    from infinigen.loading import convert_gguf, smollm2_gguf
    from infinigen.provenance import commit, machine
    from infinigen.speculate import channel_count

    model = args.model or str(convert_gguf(smollm2_gguf()))
    text = args.text or str(Path(__file__).resolve().parents[2] / "data" / "areopagitica.txt")
    batches = [int(b) for b in args.batches.split(",")]
    shape = _shape(model, args.dtype)
    cores = os.cpu_count() or 1
    rate = _memory_rate(cores)
    channels = channel_count(0.625, shape["head_dim"])
    selection = _selection_rates(shape, args.context, max(batches), channels)
    tokens = max(batches) * (-(-_model_len(args.context, args.new, batches, shape["max_positions"]) // 128) * 128)
    results, work = {}, Path(tempfile.mkdtemp(prefix="infinigen-vllm-bench-"))
    dense_tokens = None
    for row in args.rows.split(","):
        setting, eager = ROWS[row]
        env = {k: v for k, v in os.environ.items() if k != "INFINIGEN_VLLM"}
        if setting is not None:
            env["INFINIGEN_VLLM"] = setting
        memory = _row_memory(row, shape, tokens, channels)
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=f"{memory:g}")
        if args.threads == "all":
            env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                       OMP_NUM_THREADS=str(cores))  # fmt: skip
        mine = [1] if row == "oracle" else batches  # the oracle is the quality bound, not a speed row
        cfg = dict(row=row, model=model, text=text, context=args.context, new=args.new, batches=mine,
                   kl_tokens=min(args.kl_tokens, shape["max_positions"] - args.context),
                   max_positions=shape["max_positions"],
                   dtype=args.dtype, eager=eager, out=str(work / f"{row}.json"), dist=str(work / f"{row}.pt"),
                   force=dense_tokens)  # fmt: skip
        print(f"[bench vllm] {row} (KV memory {memory:g} GiB) ...", file=sys.stderr, flush=True)
        done = subprocess.run(
            [sys.executable, "-m", "infinigen.integrations.vllm.bench", "--child", json.dumps(cfg)], env=env
        )
        if done.returncode:
            raise SystemExit(f"row {row} failed (exit {done.returncode})")
        results[row] = json.loads((work / f"{row}.json").read_text())
        results[row]["kv_memory_gib"] = memory
        results[row]["dist_path"] = str(work / f"{row}.pt")
        if row == "vllm":
            dense_tokens = results[row]["forced_tokens"]
    _derive(results, shape, rate, args)
    report = {
        "settings": vars(args) | {"model": model, "text": text},
        "commit": commit(),
        "machine": machine() | {"memory_read_bytes_per_s": rate},
        "model_shape": shape,
        "selection_kernel_bytes_per_s": selection,
        "rows": results,
    }
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(_table(results, batches, args, rate))
    print(
        f"Selection kernel alone, B = {max(batches)}, {args.context} positions, mass, 10 % (GB/s of codes): "
        + "; ".join(f"{path} {', '.join(f'{k} {v / 1e9:.1f}' for k, v in r.items())}" for path, r in selection.items())
    )
    print(f"wrote {args.json}")
    return 0


def _derive(results: dict, shape: dict, rate: float, args) -> None:
    """Bytes per step, floors, efficiencies, ratios against vLLM's faster mode, tokens and KL."""
    import torch

    own = [r for r in ("vllm", "vllm-compiled") if r in results]
    ctx = args.context + args.new / 2  # the mean context over the decode
    for r in results.values():
        for b, br in r["batches"].items():
            n = int(b)
            if "bytes_read_per_step" in br:  # the plugin: its counters
                kv = br["bytes_read_per_step"] + br["codes_read_per_step"]
            else:  # vLLM's own reads every cached position of every layer
                kv = n * ctx * shape["kv_bytes_per_token"]
            br["kv_bytes_per_step"] = kv
            br["bytes_per_step"] = kv + shape["weight_bytes"]
            # the byte floor: every byte of the step at the memory's read rate; the step floor: this
            # row's own step over 64 positions (its compute, the weights' matmuls included) plus its
            # KV bytes at that rate
            br["floor_s"] = br["bytes_per_step"] / rate
            br["step_floor_s"] = br["short_step_s"] + kv / rate
            ok = br["step_s"] == br["step_s"]
            br["efficiency"] = br["floor_s"] / br["step_s"] if ok else float("nan")
            br["step_efficiency"] = br["step_floor_s"] / br["step_s"] if ok else float("nan")
            br["full_batch"] = br["requests_at_once"] == n and br["full_steps"] > 0
    for b in dict.fromkeys(b for r in results.values() for b in r["batches"]):
        fastest = max((x for x in own if b in results[x]["batches"]), key=lambda x: results[x]["batches"][b]["tok_s"],
                      default=None)  # fmt: skip
        for r in results.values():
            if b not in r["batches"]:
                continue
            br = r["batches"][b]
            if fastest is not None:
                br["vs_vllm"] = br["tok_s"] / results[fastest]["batches"][b]["tok_s"]
                br["vllm_faster_mode"] = fastest
                mine, theirs = br["tokens"], results[fastest]["batches"][b]["tokens"]
                same = sum(x == y for m, t in zip(mine, theirs) for x, y in zip(m, t))
                br["tokens_equal_share"] = same / max(1, sum(len(t) for t in theirs))

    # KL (each row's forced distribution was saved beside its JSON)
    def dist(row: str):
        path = results.get(row, {}).get("dist_path")
        return torch.load(path) if path and Path(path).is_file() else None

    base, full = dist("vllm"), dist("full")
    for row, r in results.items():
        mine = dist(row)
        if mine is None:
            continue
        if base is not None:
            r["kl_vs_vllm"] = _kl(base, mine)
        if full is not None:
            r["kl_vs_full"] = _kl(full, mine)
    if "kl_vs_full" in results.get("oracle", {}):
        for r in results.values():
            if "kl_vs_full" in r and results["oracle"]["kl_vs_full"] > 0:
                r["kl_x_oracle"] = r["kl_vs_full"] / results["oracle"]["kl_vs_full"]


def _table(results: dict, batches: list[int], args, rate: float) -> str:
    mib = 1 << 20
    lines = [
        f"vLLM CPU, SmolLM2-135M {args.dtype}, {args.context} tokens of context, {args.new} new, threads: {args.threads}; "
        f"memory read rate {rate / 1e9:.1f} GB/s (measured here); decode = median pure-decode step",
        "| row | B | at once | tok/s (x vLLM's faster) | step ms | MiB/step (KV + weights) | byte floor ms (eff.) | "
        "step at 64 positions ms | step floor ms (eff.) | prefill s | blocks | KV memory GiB | peak RSS MiB | tokens = vLLM's |",
        "|" + "---|" * 14,
    ]
    for row, r in results.items():
        for b in batches:
            if str(b) not in r["batches"]:
                continue
            br = r["batches"][str(b)]
            mark = "" if br["full_batch"] else " (FEWER THAN B)"
            lines.append(
                f"| {row} | {b} | {br['requests_at_once']}{mark} | {br['tok_s']:.2f} ({br.get('vs_vllm', float('nan')):.2f}) | "
                f"{br['step_s'] * 1e3:.1f} | {br['bytes_per_step'] / mib:.0f} | {br['floor_s'] * 1e3:.1f} "
                f"({br['efficiency']:.2f}) | {br['short_step_s'] * 1e3:.1f} | {br['step_floor_s'] * 1e3:.1f} "
                f"({br['step_efficiency']:.2f}) | {br['prefill_s']:.1f} (B={br['prefill_batch']}) | {r['blocks']} | "
                f"{r['kv_memory_gib']:g} | "
                f"{r['peak_rss_bytes'] / mib:.0f} | {br.get('tokens_equal_share', float('nan')):.0%} |"
            )
    kl = [f"{row}: KL vs vLLM {r.get('kl_vs_vllm', float('nan')):.4f}, vs full {r.get('kl_vs_full', float('nan')):.4f}"
          f" (x oracle {r.get('kl_x_oracle', float('nan')):.2f})" for row, r in results.items()]  # fmt: skip
    return "\n".join(lines + ["", "Teacher-forced KL, B = 1: " + "; ".join(kl)])


if __name__ == "__main__":
    raise SystemExit(main())
