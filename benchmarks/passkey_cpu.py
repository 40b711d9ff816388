"""Dense vs sparse on the main job: passkey retrieval through vLLM's OpenAI server, same machine, same run.

    python benchmarks/passkey_cpu.py [--contexts 8192 16384] [--depths 0.5] \
        [--backends CPU_ATTN sparse_quoka sparse_quoka@0.25] [--sparse-config '{"dense_below_tokens": 1024}']

A backend ``NAME@F`` runs ``NAME`` with a budget fraction ``F`` (else the shipped config's). Writes
benchmarks/results/passkey_cpu_<context>.json (one context) or passkey_cpu_<name>.json (``--name``), with
the machine, the command, the load average before and after, and every record.
"""

from __future__ import annotations

import argparse
import json
import os
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


def cpu_run_record(load_before: tuple, note: str, records: list) -> dict:
    """A CPU run's JSON: the exact command, date, machine, versions and load average around it, and ``records``."""
    import torch
    import vllm

    return {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "note": note,
        "records": records,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192])
    p.add_argument("--depths", type=float, nargs="+", default=[0.5])
    p.add_argument("--backends", nargs="+", default=["CPU_ATTN", "sparse_quoka"])
    p.add_argument("--sparse-config", default=None, help="JSON fields added to every sparse backend's config")
    p.add_argument("--name", default=None)
    args = p.parse_args()
    load_before = os.getloadavg()
    records = []
    for context in args.contexts:
        for depth in args.depths:
            for label in args.backends:
                backend, _, fraction = label.partition("@")
                cfg = json.loads(args.sparse_config) if args.sparse_config and "sparse" in backend else {}
                if fraction:
                    cfg["budget"] = {**cfg.get("budget", {}), "fraction": float(fraction)}
                extra = {"sparse_attention": cfg} if cfg else None
                r = run_passkey(args.model, backend, context, depth, additional_config=extra)
                r["label"] = label
                print_result(r)
                records.append(r)

    note = "TTFT from the streamed chat request (one request, server already warm from /health only)."
    out = cpu_run_record(load_before, note, records)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = args.name or (str(args.contexts[0]) if len(args.contexts) == 1 else "sweep")
    path = RESULTS / f"passkey_cpu_{name}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
