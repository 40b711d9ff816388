#!/usr/bin/env bash
# session 27, machine 2 (the first machine went back mid-run, its serving results lost): the selection micro-benchmark
# and issue 11's decode loads for FLASH_ATTN and sparse_quest (micro_serve.sh), then the whole tests/gpu folder
# (tests.sh). Run as `bash benchmarks/results/gpu_session27/all.sh` after gpu_setup.
D="$(cd "$(dirname "$0")" && pwd)"
bash "$D/micro_serve.sh" FLASH_ATTN,sparse_quest
bash "$D/tests.sh"
