#!/usr/bin/env bash
# Run the installed `infinigen` of a venv as a user would, from a folder with nothing of this
# repository in it: its version, where it imports from, and greedy text of full fetch (16-bit rows
# read back from the slow tier) against dense on a real prompt, which must be the same text.
# Usage: bash scripts/generate_from.sh VENV [PROMPT_BYTES]   (default: 3000 bytes of the demo prompt)
set -euo pipefail
venv=$(cd "$1" && pwd)
bytes=${2:-3000}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
head -c "$bytes" "$root/src/infinigen/data/areopagitica_opening.txt" >"$work/prompt.txt"
cd "$work"
"$venv/bin/infinigen" --version
"$venv/bin/python" - "$root" <<'PY'
import os
import sys

import infinigen
import transformers

source = os.path.join(sys.argv[1], "src") + os.sep
assert not infinigen.__file__.startswith(source), f"imported from the source tree: {infinigen.__file__}"
print(f"infinigen imported from {infinigen.__file__} | transformers {transformers.__version__}")
PY
for policy in dense full; do
    "$venv/bin/infinigen" generate --prompt-file prompt.txt --max-new-tokens 12 --policy "$policy" --json --quiet \
        >"$policy.json"
done
"$venv/bin/python" - <<'PY'
import json

dense, full = (json.load(open(f"{p}.json")) for p in ("dense", "full"))
for name, run in (("dense", dense), ("full", full)):
    print(f"{name:>5}: {run['text']!r} ({run['prompt_tokens']}-token prompt, fetched {run['fetched_fraction']})")
assert full["text"] == dense["text"], "full fetch's text differs from dense's: the cache path is broken"
print("full fetch gives dense's text")
PY
