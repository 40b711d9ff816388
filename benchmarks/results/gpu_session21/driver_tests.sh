#!/usr/bin/env bash
# session-21 machine 1 (one H100), after driver_eval.sh on the same machine: the whole tests/gpu folder on the
# committed tree (91c1c60; session 20 left its final quest_score.py untested on a GPU). Run there as
# `bash driver_tests.sh "$(pwd)"` from the copied working tree.
cd /tmp && rm -rf /tmp/repo21t && cp -r "$1" /tmp/repo21t && cd /tmp/repo21t
source /tmp/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/s21t; mkdir -p $M
nvidia-smi > $M/nvidia_smi.txt
bash benchmarks/gpu_tests.sh $M/tests > $M/tests.out 2>&1; echo "gpu tests rc=$?" >> $M/status
echo done >> $M/status
