"""What vLLM itself allocates for its KV pool, with and without the plugin (a measurement, not a
test): at the same KV memory, the blocks it fits; at a fixed block count, the pool's bytes. Read
from vLLM's own KV cache configuration (the tensors it allocates), one process per setting.

    python -m infinigen.integrations.vllm.pool --memory-gib 1 --blocks 364
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROWS = {"vllm": None, "full": "policy=full", "infinigen": "policy=infinigen"}


def _child(spec: dict) -> None:
    from vllm import LLM

    args = dict(model=spec["model"], dtype=spec["dtype"], enforce_eager=True, max_model_len=spec["context"],
                enable_prefix_caching=False)  # fmt: skip
    if spec["blocks"]:
        args["num_gpu_blocks_override"] = spec["blocks"]
    llm = LLM(**args)
    core = llm.llm_engine.engine_core.engine_core  # one process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    config = core.scheduler.kv_cache_config
    cache = llm.llm_engine.vllm_config.cache_config
    out = {"blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
           "pool_bytes": sum(t.size for t in config.kv_cache_tensors)}  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--memory-gib", type=float, default=1.0)
    ap.add_argument("--blocks", type=int, default=364, help="the fixed block count of the second measurement")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    from infinigen.loading import convert_gguf, smollm2_gguf

    model = args.model or str(convert_gguf(smollm2_gguf()))
    print(f"vLLM's KV pool, {args.dtype}: at {args.memory_gib:g} GiB of KV memory, and at {args.blocks} blocks")
    print(
        "| row | blocks at the same memory | sequences of the context | pool bytes at that memory | pool bytes at "
        f"{args.blocks} blocks |\n|---|---|---|---|---|"
    )
    for row, setting in ROWS.items():
        env = {k: v for k, v in os.environ.items() if k != "INFINIGEN_VLLM"}
        if setting:
            env["INFINIGEN_VLLM"] = setting
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=f"{args.memory_gib:g}")
        got = []
        for blocks in (0, args.blocks):
            spec = dict(model=model, dtype=args.dtype, context=args.context, blocks=blocks)
            done = subprocess.run([sys.executable, "-m", "infinigen.integrations.vllm.pool", "--child", json.dumps(spec)],
                                  env=env, capture_output=True, text=True)  # fmt: skip
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(done.stderr[-3000:])
                return 1
            got.append(json.loads(line[7:]))
        same, fixed = got
        per_seq = -(-args.context // same["block_size"])
        print(f"| {row} | {same['blocks']} | {same['blocks'] // per_seq} | {same['pool_bytes'] / 2**20:.1f} MiB | "
              f"{fixed['pool_bytes'] / 2**20:.1f} MiB ({fixed['blocks']} blocks) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
