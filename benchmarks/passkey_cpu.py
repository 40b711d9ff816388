"""Dense vs sparse on the main job: passkey retrieval through vLLM's OpenAI server, same machine, same run.

    python benchmarks/passkey_cpu.py [--context 8192] [--depths 0.25 0.5 0.75]

Writes benchmarks/results/passkey_cpu_<context>.json with the machine, the command and every record.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from vllm_sparse.demo import print_result, run_passkey

RESULTS = Path(__file__).parent / "results"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--depths", type=float, nargs="+", default=[0.5])
    p.add_argument("--backends", nargs="+", default=["CPU_ATTN", "sparse_quoka"])
    args = p.parse_args()
    records = []
    for depth in args.depths:
        for backend in args.backends:
            r = run_passkey(args.model, backend, args.context, depth)
            print_result(r)
            records.append(r)
    import os

    import torch
    import vllm

    out = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "note": "TTFT from the streamed chat request (one request, server already warm from /health only); "
        "sparse_quoka runs the torch reference executor on CPU.",
        "records": records,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"passkey_cpu_{args.context}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
