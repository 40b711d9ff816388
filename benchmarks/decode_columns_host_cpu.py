"""Host time of a decode step's columns (``DecodeColumns.write``), the builder's per-step work between
CUDA-graph replays: looked up in the tables made at start, against computed every step
(``policy.decode_columns`` per policy, the path before the tables and the one past ``TABLE_BYTES``).

Quest's served config (12.5%, layer 0 dense: two layer policies), pages of 32, ``max_model_len`` 131072,
``--batch`` requests of ``--context`` tokens; CPU time per call (``time.process_time``), median of
``--rounds`` rounds of ``--calls`` calls. Run it on an idle machine.

    python benchmarks/decode_columns_host_cpu.py --out FILE.json [--batch 16] [--context 16100]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vllm_sparse.decode_step as ds  # noqa: E402
from vllm_sparse.config import SparseConfig  # noqa: E402


def per_call_us(buf: ds.DecodeColumns, seq: np.ndarray, table: torch.Tensor, calls: int, rounds: int) -> float:
    for _ in range(200):
        buf.write(seq, table)
    times = []
    for _ in range(rounds):
        t = time.process_time()
        for _ in range(calls):
            buf.write(seq, table)
        times.append((time.process_time() - t) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=16100)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    cfg = SparseConfig(method="quest", budget={"fraction": 0.125})
    policies = [cfg.for_layer(0), cfg.for_layer(1)]
    seq = np.full(args.batch, args.context, dtype=np.int64)
    table = torch.zeros(256, 4200, dtype=torch.int32)
    r = {"batch": args.batch, "context": args.context, "policies": len(policies)}
    t = time.perf_counter()
    looked_up = ds.DecodeColumns(policies, 32, 256, 131072, "cpu", num_kv_heads=8)
    r["tables_build_ms"] = (time.perf_counter() - t) * 1e3
    saved, ds.TABLE_BYTES = ds.TABLE_BYTES, 0
    try:
        computed = ds.DecodeColumns(policies, 32, 256, 131072, "cpu", num_kv_heads=8)
    finally:
        ds.TABLE_BYTES = saved
    assert looked_up._tables is not None and computed._tables is None
    r["computed_us"] = per_call_us(computed, seq, table, args.calls, args.rounds)
    r["looked_up_us"] = per_call_us(looked_up, seq, table, args.calls, args.rounds)
    out = {"benchmark": __doc__.splitlines()[0], "command": "python " + " ".join(sys.argv),
           "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
           "torch": torch.__version__, "results": [r]}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(r))


if __name__ == "__main__":
    main()
