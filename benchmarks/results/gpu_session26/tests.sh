#!/usr/bin/env bash
# session 26: the whole tests/gpu folder (benchmarks/gpu_tests.sh) on the final code.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo26t && cp -r . /tmp/repo26t && cd /tmp/repo26t
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
bash benchmarks/gpu_tests.sh /tmp/s26/tests; echo "tests rc=$?" >> /tmp/s26/tests/status
echo done >> /tmp/s26/tests/status
