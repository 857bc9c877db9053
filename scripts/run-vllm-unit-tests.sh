#!/usr/bin/env bash
# Runs vLLM's own CPU unit tests for the files the speckv plugin patches, once with the plugin
# switched off and once with it loaded the way vLLM loads it (vllm.plugins.load_general_plugins),
# and fails if any test that passes without the plugin does not pass with it.
#
# usage: scripts/run-vllm-unit-tests.sh VENV VLLM_SOURCE_DIR [TEST_FILE ...]
#   VENV             a venv with vLLM, pytest and speckv (pip install --no-deps -e .)
#   VLLM_SOURCE_DIR  the unpacked vLLM source of the same version (its tests/ directory),
#                    e.g. `pip download --no-deps --no-binary :all: vllm==X` then tar xzf
#   TEST_FILE        paths under VLLM_SOURCE_DIR; default: the kv-cache and scheduler tests
# Not run in CI: it needs a vLLM venv and vLLM's sources, and takes minutes.
set -euo pipefail
venv=${1:?usage: $0 VENV VLLM_SOURCE_DIR [TEST_FILE ...]}
src=${2:?usage: $0 VENV VLLM_SOURCE_DIR [TEST_FILE ...]}
shift 2
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  files=(tests/v1/core/test_kv_cache_utils.py tests/v1/core/test_prefix_caching.py
         tests/v1/core/test_single_type_kv_cache_manager.py tests/v1/core/test_scheduler.py
         tests/v1/core/test_async_scheduler.py tests/v1/core/test_prefix_replay.py
         tests/v1/core/test_kv_sharing.py tests/v1/core/test_deferred_block_free.py)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# a pytest plugin that loads vLLM's general plugins before collection and checks that speckv's
# patches are in place, so a run "with the plugin" cannot silently run unpatched
cat > "$work/speckv_loaded.py" <<'PY'
def pytest_configure(config):
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched.scheduler import Scheduler
    load_general_plugins()
    if not hasattr(Scheduler.__init__, "_speckv_original"):
        raise RuntimeError("speckv's vLLM plugin did not patch Scheduler.__init__")
PY
# vLLM's scheduler tests build a ModelConfig for facebook/opt-125m and read only its sizes: an
# offline Hugging Face cache holding that model's public config.json (no weights) stands in
snap="$work/hf/hub/models--facebook--opt-125m/snapshots/0000000000000000000000000000000000000000"
mkdir -p "$snap" "$work/hf/hub/models--facebook--opt-125m/refs"
printf 0000000000000000000000000000000000000000 > "$work/hf/hub/models--facebook--opt-125m/refs/main"
cat > "$snap/config.json" <<'JSON'
{"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
 "num_attention_heads": 12, "num_hidden_layers": 12, "ffn_dim": 3072,
 "max_position_embeddings": 2048, "vocab_size": 50272, "word_embed_proj_dim": 768,
 "torch_dtype": "float16", "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2,
 "do_layer_norm_before": true, "activation_function": "relu", "enable_bias": true}
JSON
py="$venv/bin/python"
# no network: tests that need any other Hugging Face model fail fast instead of retrying
export HF_HOME="$work/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_TARGET_DEVICE=cpu
# --noconftest: vLLM's top-level tests/conftest.py needs its full test requirements
run() {  # run NAME [pytest args]
  local name=$1; shift
  (cd "$src" && PYTHONPATH="$work:${PYTHONPATH:-}" "$py" -m pytest --noconftest -q \
     -p no:cacheprovider --junitxml="$work/$name.xml" "$@" "${files[@]}" >"$work/$name.log" 2>&1) || true
  tail -1 "$work/$name.log"
}
echo "without the plugin:"; SPECKV_VLLM_PLUGIN=0 run off
echo "with the plugin:"; run on -p speckv_loaded
"$py" - "$work/off.xml" "$work/on.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

def outcomes(path):
    result = {}
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failed = any(case.find(tag) is not None for tag in ("failure", "error", "skipped"))
        result[name] = not failed
    return result

off, on = outcomes(sys.argv[1]), outcomes(sys.argv[2])
print(f"tests: {len(off)}; pass without the plugin: {sum(off.values())}; "
      f"pass with it: {sum(on.values())}")
skew = sorted(n for n, ok in off.items() if not ok)
print(f"fail, error or skip without the plugin (environment: no GPU, no network): {len(skew)}")
for name in skew:
    print("   without the plugin, not passing:", name)
broken = sorted(n for n, ok in off.items() if ok and not on.get(n, False))
for name in broken:
    print("PASSES WITHOUT THE PLUGIN, NOT WITH IT:", name)
sys.exit(1 if broken else 0)
PY
