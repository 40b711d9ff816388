#!/usr/bin/env bash
# On a lent GPU host (no network): install the staged vLLM + FlashInfer set once per machine (parts
# carried to /tmp/stage, see ../shared/gpu-wheelhouse) and this package, then print the line to eval.
#   eval "$(bash benchmarks/gpu_setup.sh)"
set -euo pipefail
if [ ! -f /tmp/site/.vllm_sparse_installed ]; then
  bash .stage/install.sh /tmp/stage > /dev/null
  touch /tmp/site/.vllm_sparse_installed
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# not editable: the working tree is copied afresh for every command
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . >&2
echo "export PYTHONPATH=$PYTHONPATH"
