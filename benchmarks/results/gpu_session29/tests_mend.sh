#!/usr/bin/env bash
# session 29, fifth H100: the whole tests/gpu folder on the review mend (464ca43). Run as
# `bash benchmarks/results/gpu_session29/tests_mend.sh` after gpu_setup; results under /tmp/s29m.
cd "$(dirname "$0")/../../.." && rm -rf /tmp/repo29m && cp -r . /tmp/repo29m && cd /tmp/repo29m
source /tmp/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
mkdir -p /tmp/s29m
bash benchmarks/gpu_tests.sh /tmp/s29m; echo "tests rc=$?" >> /tmp/s29m/status
echo done >> /tmp/s29m/status
