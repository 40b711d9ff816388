#!/usr/bin/env bash
# session 27: the whole tests/gpu folder (benchmarks/gpu_tests.sh) on the final code.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo27t && cp -r . /tmp/repo27t && cd /tmp/repo27t
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
bash benchmarks/gpu_tests.sh /tmp/s27/tests; echo "tests rc=$?" >> /tmp/s27/tests/status
echo done >> /tmp/s27/tests/status
