#!/usr/bin/env bash
# The GPU check (not part of CI): a random-init Llama-3-8B-layout model (a few layers) with a
# random EAGLE3 head through the engine on CUDA: greedy equals transformers on the same weights,
# hit KV equals cold KV, tokens/s beside transformers' batched generate. Under 5 minutes on one
# GPU. Exits 1 with a message on a machine without CUDA; `--device cpu` rehearses it tiny.
#   bash scripts/gpu_check.sh [--layers 4] [--dtype float32] [--device cpu] [--json]
set -euo pipefail
cd "$(dirname "$0")/.."
exec env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -m speckv.bench.gpu_check "$@"
