#!/usr/bin/env bash
# The GPU check on a machine that has a GPU, torch and transformers and nothing installed from
# this repository (a lent GPU machine): `eagle-ray bench gpu` from the working tree, its JSON
# lines in $OUT/bench-gpu.jsonl (default: the current folder). Ray is optional: with it on
# PYTHONPATH the pool comparison runs too. About 4-6 minutes on one H100/H200.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
nvidia-smi -L
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" python -m eagle_ray.cli bench gpu --device cuda \
  > "$out/bench-gpu.jsonl" 2> "$out/bench-gpu.log"
cat "$out/bench-gpu.jsonl"
