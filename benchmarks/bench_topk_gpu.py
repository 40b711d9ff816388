"""GPU micro-benchmark of the decode top-k (``kernels.page_topk.select_top_pages_triton``): the split
passes as five launches against one launch whose chunk programs meet at barriers (``fused``), at
several chunk counts, and the one-program-a-row kernel.

Llama-3.1-8B shapes (8 KV heads, pages of 16, ``max_model_len`` 132K: rows 8449 pages wide), Quest's
decode columns at 12.5% (``sparse_decode: true``), random continuous scores. Two timings per
variant, both of CUDA-graph replays with CUDA events (median of ``--reps``):

* ``flushed_ms``: one call per replay, the L2 flushed before each (``gpu_timing.Timer``);
* ``chained_ms``: a graph of ``--chain`` calls back to back, divided by the count: what a layer pays
  inside vLLM's full graph, where the scores come straight from the scoring kernel (the graph's own
  launch paid once).

Each variant's pages are checked against the five-launch split's (``same``). ``--baseline FILE``: a
copy of an earlier ``page_topk.py`` (e.g. ``git show REV:vllm_sparse/kernels/page_topk.py``) whose
default call is timed beside the current one in the same process (``baseline_default``);
``--variants default``: only the default call (and the baseline's).

    python benchmarks/bench_topk_gpu.py --out FILE.json [--reps 30] [--cases 1:131072,16:16384]
        [--page-size 32] [--baseline OLD_page_topk.py] [--variants all|default]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import Timer, graphed, write_results

from vllm_sparse.config import SparseConfig
from vllm_sparse.decode_step import DecodeColumns
from vllm_sparse.kernels.page_topk import select_top_pages_triton, split_chunks
from vllm_sparse.kernels.paged_attention import num_sms
from vllm_sparse.policy import HEAD, SELECT, TAIL

HKV, N = 8, 16
MAX_MODEL_LEN = 131072 + 4096


def same_selection(a, b, counts) -> bool:
    k = max(1, int(counts.max()))
    a, b = a[:, :k].sort(dim=1).values, b[:, :k].sort(dim=1).values
    keep = torch.arange(k, device=a.device)[None, :] < counts[:, None]
    return bool(torch.equal(torch.where(keep, a, 0), torch.where(keep, b, 0)))


def load_baseline(path: str):
    """An earlier ``page_topk`` module from a copy of its file (its kernels compile beside the current ones)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("page_topk_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(timer, batch: int, context: int, chain: int, baseline=None, only_default: bool = False) -> dict:
    cfg = SparseConfig(method="quest", sparse_decode=True)
    policy = cfg.for_layer(1)
    pages = -(-(context + 1) // N)
    table = torch.randperm(batch * pages + 64, device="cuda")[: batch * pages].view(batch, pages).int()
    step = DecodeColumns([policy], N, batch, MAX_MODEL_LEN, "cuda", num_kv_heads=HKV).write(
        np.full(batch, context + 1), table
    )
    cols, k_cap = step.columns[policy], step.select_caps[policy]
    rows = batch * HKV
    scores = torch.randn(rows, step.page_cap, device="cuda")
    sms = num_sms(scores.device)
    default_chunks = split_chunks(step.page_cap, rows, sms)
    variants = {"default": {}}
    if not only_default:
        variants |= {"split": dict(fused=False), "one_program": dict(chunks=1, fused=False)}
        for c in sorted({1, 2, 4, 8, 16, 32, default_chunks}):
            if rows * c <= sms or c == 1:
                variants[f"fused_{c}"] = dict(chunks=c, fused=True)
    host = step.host_columns[policy][0]
    r = {"batch": batch, "context": context, "rows": rows, "page_cap": step.page_cap,
         "selectable": int(host[TAIL] - host[HEAD]), "k": int(host[SELECT]), "default_chunks": default_chunks}  # fmt: skip
    ref = select_top_pages_triton(scores, cols, HKV, k_cap, fused=False)
    calls = {name: (select_top_pages_triton, kw) for name, kw in variants.items()}
    if baseline is not None:
        calls["baseline_default"] = (baseline.select_top_pages_triton, {})
    for name, (select, kw) in calls.items():
        state = {}

        def call(kw=kw, state=state, select=select):
            state["out"] = select(scores, cols, HKV, k_cap, counters=step.topk_counters, **kw)

        flushed = timer(graphed(call))
        same = same_selection(state["out"][0], ref[0], ref[1]) and torch.equal(state["out"][1], ref[1])
        r[name] = {"flushed_ms": flushed, "chained_ms": timer(graphed(call, chain)) / chain, "same": same}
    print(json.dumps(r), flush=True)
    return r


def main() -> None:
    global N
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--cases", default="1:131072,2:131072,4:131072,1:32768,16:16384,16:131072,64:32768")
    ap.add_argument("--page-size", type=int, default=N, help="tokens per page (Quest's GPU default is 32)")
    ap.add_argument("--baseline", help="a copy of an earlier page_topk.py, its default call timed beside")
    ap.add_argument("--variants", choices=["all", "default"], default="all")
    args = ap.parse_args()
    N = args.page_size
    baseline = load_baseline(args.baseline) if args.baseline else None
    torch.manual_seed(0)
    t0 = time.time()
    timer = Timer(args.reps)
    results = [
        case(timer, *map(int, c.split(":")), args.chain, baseline, args.variants == "default")
        for c in args.cases.split(",")
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_results(out, "topk_gpu", "quest columns, 12.5%", results, triton=triton.__version__, page_size=N,
                  sms=num_sms(torch.device("cuda")), seconds=round(time.time() - t0, 1),
                  timing="CUDA-graph replays, CUDA events, median of reps; flushed: L2 flushed, one call; "
                  "chained: calls back to back in one graph, per call")  # fmt: skip


if __name__ == "__main__":
    main()
