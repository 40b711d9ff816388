"""Attention recall of every selector on Qwen2.5-Coder-0.5B-Instruct, CPU only (issue 16, item 3).

Replaces ``quest_recall_cpu.py`` (Quest and Twilight at 2K tokens of one text): the measure now lives
in ``vllm_sparse/eval/recall*.py`` (``vllm-sparse recall``), uses the eval tasks' own prompts, the
shipped config's settings, chunked prefill as vLLM runs it, and a decode step. This script reruns
the recorded results in ``benchmarks/results/attention_recall_qwen0.5b_cpu/`` (8K: 9 prompts, about
16 minutes on 2 shared cores; 16K: 3 prompts, about 19 minutes):

    python benchmarks/attention_recall.py [8k] [16k]

Quest's other GQA rules or other Twilight top-p values are variants, e.g.
``--variant 'quest_sum=quest:{"quest": {"gqa_reduce": "sum"}}'`` on ``vllm-sparse recall``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_sparse.cli import main

OUT = "benchmarks/results/attention_recall_qwen0.5b_cpu"
VARIANTS = ["--variant", 'quoka_w64=quoka:{"chunk_query_window": 64}',
            "--variant", 'quest_w64=quest:{"chunk_query_window": 64}']  # fmt: skip
RUNS = {
    "8k": ["--tasks", "niah_single", "niah_multikey", "vt", "--contexts", "8192", "--samples", "3"],
    "16k": ["--tasks", "niah_single", "--contexts", "16384", "--samples", "3"],
}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(RUNS):
        args = ["recall", *RUNS[name], "--depths", "0.1", "0.5", "0.9", *VARIANTS, "--out", f"{OUT}/{name}"]
        sys.argv = ["vllm-sparse", *args]  # recorded in the JSON as the command
        if main(args):
            sys.exit(1)
