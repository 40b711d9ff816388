#!/usr/bin/env bash
# session 31, machine 4 (one H100): Kascade's decode per layer, summed over the 32 layers, and as one graph of the 32
# layers back to back against 32 dense FlashAttention layers in one graph, at pages of 16 and 32 (issue 13's decode
# target). Machine 3's run of the graphs failed on an illegal address (a captured reuse layer read a pick that the host
# had freed; the bench now holds every pick while the graph lives). Results under $1 (default /tmp/s31c).
S=${1:-/tmp/s31c}; mkdir -p $S
cd "$(dirname "$0")/../../.."
source /tmp/env.sh
export PYTHONUNBUFFERED=1
nvidia-smi > $S/nvidia_smi.txt
for P in 16 32; do
  python3 benchmarks/bench_kascade_decode_gpu.py --out $S/decode --page-size $P > $S/decode_pages$P.log 2>&1
  echo "decode pages $P rc=$?" >> $S/status
done
