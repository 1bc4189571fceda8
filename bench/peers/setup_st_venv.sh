#!/usr/bin/env bash
# Build the separate virtualenv that runs sentence-transformers beside nanoflex
# (bench/peers/embed_corpus.py's peer). It lives outside the repo and is never a dependency.
#
#   bash bench/peers/setup_st_venv.sh              # -> /opt/venvs/sentence-transformers
#   ST_VENV=/some/dir bash bench/peers/setup_st_venv.sh
set -euo pipefail
venv=${ST_VENV:-/opt/venvs/sentence-transformers}
python=${PYTHON:-python3}
mkdir -p "$(dirname "$venv")"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==2.13.0" "sentence-transformers"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import sentence_transformers, torch; print('sentence-transformers', sentence_transformers.__version__, 'torch', torch.__version__)"
