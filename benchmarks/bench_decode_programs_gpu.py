"""How many programs per row the decode scoring kernels should take: Quest's bounds
(``quest_decode_bounds_triton``) and Twilight's INT4 estimate (``decode_page_lse_triton``) at
multiples of ``programs_per_row`` (which aims for 4 programs per SM), pages per tile too for the
estimate. Latency-bound kernels (each tile waits on a chain of dependent loads: candidates, block
table, shadows) may want more programs in flight than bandwidth-bound ones.

Llama-3.1-8B shapes (32 query heads, 8 KV heads, d 128, bf16, pages of 16), shipped defaults at
12.5% (``sparse_decode: true``), the cache and its metadata as ``step_breakdown_gpu.Cache`` makes
them. Per variant: ``chained_ms``, a CUDA graph of ``--chain`` calls back to back divided by the
count (what a layer pays inside vLLM's full graph), CUDA events, median of ``--reps``.

    python benchmarks/bench_decode_programs_gpu.py --out FILE.json [--cases 16:16384,1:131072]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import Timer, graphed, write_results
from step_breakdown_gpu import DTYPE, HKV, HQ, MAX_MODEL_LEN, SCALE, Cache, N

from vllm_sparse.config import SparseConfig
from vllm_sparse.decode_step import DecodeColumns
from vllm_sparse.kernels.decode_rows import programs_per_row
from vllm_sparse.kernels.quest_score import quest_decode_bounds_triton
from vllm_sparse.kernels.twilight_estimate import decode_page_lse_triton
from vllm_sparse.policy import HEAD, SELECT, TAIL
from vllm_sparse.selectors import make_selector
from vllm_sparse.selectors.twilight import forced_cap

MULTIPLES = (0.25, 0.5, 1, 2)  # of programs_per_row (the bounds skip the first)
BOUNDS_TILES = [(64, 4, None), (32, 4, None), (128, 4, None), (128, 8, None), (64, 4, 2), (64, 4, 4), (64, 8, 3)]


def case(timer, b: int, ctx: int, chain: int) -> dict:
    c = Cache("twilight", b, ctx + 1, 0)
    query = torch.randn(b, HQ, 128, device="cuda", dtype=DTYPE)
    cfg = SparseConfig(method="twilight", sparse_decode=True)
    policy = cfg.for_layer(1)
    step = DecodeColumns([policy], N, b, MAX_MODEL_LEN, "cuda", num_kv_heads=HKV).write(
        np.full(b, ctx + 1), c.block_table
    )
    cols = step.columns[policy]
    rows = b * HKV
    r = {"batch": b, "context": ctx, "rows": rows, "bounds": {}, "estimate": {}}
    sel = cols[:, SELECT].repeat_interleave(HKV) > 0
    lo, hi = int(cols[0, HEAD]), int(cols[0, TAIL])  # every request has the same length here
    want = quest_decode_bounds_triton(query, c.meta.kmin, c.meta.kmax, step.block_table, cols, step.page_cap)
    for block_p, warps, stages in BOUNDS_TILES:
        base = programs_per_row(rows, step.page_cap, block_p, query.device)
        for m in MULTIPLES[1:]:
            progs = max(1, int(base * m))
            out = {}

            def bounds(progs=progs, block_p=block_p, warps=warps, stages=stages, out=out):
                out["u"] = quest_decode_bounds_triton(query, c.meta.kmin, c.meta.kmax, step.block_table, cols,
                                                      step.page_cap, programs=progs, block_p=block_p,
                                                      num_warps=warps, num_stages=stages)  # fmt: skip

            name = f"p{block_p}_w{warps}_s{stages}_x{m}_{progs}"
            try:
                ms = timer(graphed(bounds, chain)) / chain
            except triton.runtime.errors.OutOfResources as e:  # a tile too large for shared memory
                r["bounds"][name] = {"error": str(e)[:80]}
                continue
            diff = float((out["u"][sel, lo:hi] - want[sel, lo:hi]).abs().max())
            r["bounds"][name] = {"ms": ms, "max_diff": diff}
    selector = make_selector(cfg, SCALE)
    cand, cnt = selector.base.select_decode(query, c.pk, c.layout, c.meta, step, policy)
    f_cap = forced_cap(policy, N)
    ref = None
    for block_p in (4, 16, 32):
        base = programs_per_row(rows, cand.shape[1] + f_cap, block_p, query.device)
        for m in MULTIPLES:
            progs = max(1, int(base * m))
            out = {}

            def estimate(progs=progs, block_p=block_p, out=out):
                out["lse"] = decode_page_lse_triton(query, c.meta.codes, c.meta.scale, c.meta.zero, step.block_table,
                                                    cols, cand, cnt, SCALE, f_cap, block_p=block_p, programs=progs)  # fmt: skip

            ms = timer(graphed(estimate, chain)) / chain
            lse, valid = out["lse"]
            k = int(valid.max())
            keep = torch.arange(k, device="cuda")[None, None, :] < valid[:, None, None]
            got = torch.where(keep, lse[:, :, :k], 0)
            ref = got if ref is None else ref
            r["estimate"][f"p{block_p}_x{m}_{progs}"] = {"ms": ms, "max_diff": float((got - ref).abs().max())}
    print(r, flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--cases", default="16:16384,1:131072,4:32768")
    args = ap.parse_args()
    t0 = time.time()
    timer = Timer(args.reps)
    results = [case(timer, *map(int, s.split(":")), args.chain) for s in args.cases.split(",")]
    write_results(Path(args.out), "decode_programs_gpu", "twilight (quest bounds, int4 estimate)", results,
                  triton=triton.__version__, seconds=round(time.time() - t0, 1))  # fmt: skip


if __name__ == "__main__":
    main()
