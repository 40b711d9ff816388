#!/usr/bin/env bash
# Set everything up, then run the whole test suite (unit + engine + server tests; CPU only).
# GPU tests skip with their reason when no GPU is present. Exit 5 (no tests collected) fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
source "${VENV:-.venv}/bin/activate"
set +e
python -m pytest -ra -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
