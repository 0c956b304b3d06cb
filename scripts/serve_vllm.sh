#!/usr/bin/env bash
# `vllm serve` with the infinigen plugin, and a bounded load test on localhost: REQUESTS concurrent
# OpenAI completions, each with a prompt of about PROMPT_TOKENS tokens, every one of which must come
# back whole (status 200, the asked number of tokens). Usage: serve_vllm.sh VENV
set -euo pipefail
VENV=${1:-.venv-vllm}
PORT=${PORT:-8765}
REQUESTS=${REQUESTS:-8}
PROMPT_TOKENS=${PROMPT_TOKENS:-6000}
export INFINIGEN_VLLM=${INFINIGEN_VLLM:-policy=infinigen}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
MODEL=$("$VENV/bin/python" -c 'from infinigen.loading import convert_gguf, smollm2_gguf; print(convert_gguf(smollm2_gguf(), progress=False))')
LOG=$(mktemp)
echo "vllm serve $MODEL with INFINIGEN_VLLM=$INFINIGEN_VLLM (log: $LOG)"
# vllm-cpu's `vllm` command looks up the distribution "vllm" for its --version and stops
# (PackageNotFoundError); its module entry point starts the same OpenAI server as `vllm serve`.
"$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PORT" --enforce-eager --no-enable-prefix-caching \
    --max-model-len 8192 --served-model-name smollm2 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { tail -20 "$LOG"; exit 1; }
    sleep 2
done
grep -E "KV cache size|infinigen" "$LOG" | head -5 || true
"$VENV/bin/python" - "$PORT" "$REQUESTS" "$PROMPT_TOKENS" "$MODEL" <<'PY'
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import infinigen.data
from transformers import AutoTokenizer
port, n, tokens, model = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ids = AutoTokenizer.from_pretrained(model)(Path(infinigen.data.__file__).with_name("areopagitica.txt").read_text())["input_ids"]
def ask(i):
    prompt = (ids * 2)[i * 997 : i * 997 + tokens]
    body = json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1200) as r:
        out = json.load(r)
    return r.status, out["usage"], out["choices"][0]["text"]
start = time.time()
with ThreadPoolExecutor(n) as pool:
    results = list(pool.map(ask, range(n)))
took = time.time() - start
whole = [s == 200 and u["completion_tokens"] == 16 and u["prompt_tokens"] == tokens for s, u, _ in results]
for i, (s, u, text) in enumerate(results):
    print(f"request {i}: status {s}, prompt {u['prompt_tokens']} tokens, completion {u['completion_tokens']}: {text!r}")
print(f"{sum(whole)} of {n} requests answered whole in {took:.1f} s ({n * 16 / took:.2f} generated tokens/s, prefill included)")
sys.exit(0 if all(whole) else 1)
PY
