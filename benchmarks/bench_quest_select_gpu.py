"""GPU micro-benchmark of Quest's decode selection: the bounds kernel then the top-k (two launches,
the path until session 27) against the top-k kernel scoring its rows' pages itself
(``select_top_pages_triton(quest=...)``, one launch, where the top-k runs one program a row), with a
few launch settings of the latter, and each of the two launches alone (``bounds_only``,
``topk_only``) to show where the time goes. ``*_int8``: the same over INT8 codes of the planes with a
scale per (page, KV head) (``metadata.minmax_int8``, half the bytes; a format under study), and
``int8_pages_kept``: the share of the bf16 planes' pages that the codes' selection keeps (on these
random planes). (Session 27's run also scored inside the split top-k of few long
rows; that was slower at 1 x 128K and was taken out.)

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d 128, bf16 min/max planes), pages of
``--page-size`` (Quest's GPU default 32), Quest's decode columns at 12.5% (sink 16, local 512) over a
random block table. Each variant is captured in a CUDA graph of ``--chain`` calls back to back, each
call on another layer's min/max planes (as consecutive layers read them), and its replays timed
with CUDA events (median of ``--reps``, L2 flushed before each replay, ``gpu_timing.Timer``); the
time per call is reported. Every variant's pages are checked against the two-launch path's
(``same``).

    python benchmarks/bench_quest_select_gpu.py --out FILE.json [--reps 30] [--chain 8]
        [--cases 1:131072,16:16384] [--page-size 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_decode_select_gpu
from bench_decode_select_gpu import decode_step, same_selection
from gpu_timing import Timer, graphed, write_results

from vllm_sparse.kernels.page_topk import select_top_pages_triton, split_chunks
from vllm_sparse.kernels.paged_attention import num_sms
from vllm_sparse.kernels.quest_rows import QuestRows
from vllm_sparse.kernels.quest_score import quest_decode_bounds_triton
from vllm_sparse.metadata.minmax_int8 import encode_minmax_int8
from vllm_sparse.policy import HEAD, SELECT, TAIL

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
# name -> select_top_pages_triton knobs of the one-launch path
VARIANTS = {
    "fused": {},
    "fused_warps8": {"num_warps": 8},
    "fused_stages2": {"num_stages": 2},
    "fused_stages4": {"num_stages": 4},
    "fused_block_p128": {"block_p": 128},
    "fused_block_p32": {"block_p": 32},
}


def case(timer, batch: int, context: int, chain: int) -> dict:
    policy, step, num_blocks = decode_step(batch, context)
    cols, k_cap = step.columns[policy], step.select_caps[policy]
    rows = batch * HKV
    planes = []
    for _ in range(chain):
        a = torch.randn(num_blocks, HKV, D, device="cuda", dtype=DTYPE)
        b = torch.randn(num_blocks, HKV, D, device="cuda", dtype=DTYPE)
        planes.append((torch.minimum(a, b), torch.maximum(a, b), None))
    planes8 = [encode_minmax_int8(kmin, kmax) for kmin, kmax, _ in planes]  # (codes, codes, scale)
    query = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    host = step.host_columns[policy][0]
    r = {"batch": batch, "context": context, "rows": rows, "page_cap": step.page_cap,
         "selectable": int(host[TAIL] - host[HEAD]), "k": int(host[SELECT]),
         "chunks": split_chunks(step.page_cap, rows, num_sms(query.device)),
         "minmax_mib": 2 * rows * int(host[TAIL] - host[HEAD]) * D * 2 / 2**20}  # fmt: skip

    def pair(kmin, kmax, scale):
        scores = quest_decode_bounds_triton(query, kmin, kmax, step.block_table, cols, step.page_cap, scale=scale)
        return select_top_pages_triton(scores, cols, HKV, k_cap, counters=step.topk_counters)

    def fused(kmin, kmax, scale, **kw):
        scores = torch.empty(rows, step.page_cap, device="cuda")
        quest = QuestRows(query, kmin, kmax, step.block_table, scale)
        return select_top_pages_triton(scores, cols, HKV, k_cap, counters=step.topk_counters, quest=quest, **kw)

    def bounds_only(kmin, kmax, scale):
        return quest_decode_bounds_triton(query, kmin, kmax, step.block_table, cols, step.page_cap, scale=scale), None

    scored = quest_decode_bounds_triton(query, *planes[0][:2], step.block_table, cols, step.page_cap)

    def topk_only(kmin, kmax, scale):  # (ranks the first plane's bounds every call: the top-k's own time)
        return select_top_pages_triton(scored, cols, HKV, k_cap, counters=step.topk_counters)

    # name -> (call, planes): bf16 planes, and int8 codes with a scale (``metadata.minmax_int8``), each checked
    # against the two launches over the same planes
    calls = {"pair": (pair, planes), "bounds_only": (bounds_only, planes), "topk_only": (topk_only, planes),
             "pair_int8": (pair, planes8), "bounds_only_int8": (bounds_only, planes8)}  # fmt: skip
    if r["chunks"] == 1:  # (scored inside the top-k only where it runs one program a row)
        calls |= {name: (lambda *p, kw=kw: fused(*p, **kw), planes) for name, kw in VARIANTS.items()}
        calls["fused_int8"] = (fused, planes8)
        # int8 tiles of 256 pages are the bytes of bf16 tiles of 128: half the tiles a row waits for
        calls["fused_int8_block_p256"] = (lambda *p: fused(*p, block_p=256), planes8)
    refs = {id(planes): pair(*planes[0]), id(planes8): pair(*planes8[0])}
    for name, (fn, sets) in calls.items():
        state = {"i": 0}
        ref = refs[id(sets)]

        def call(fn=fn, state=state, sets=sets):
            state["out"] = fn(*sets[state["i"] % chain])
            state["i"] += 1

        try:
            state["i"] = 0
            call()
            same = name.startswith("bounds_only") or (same_selection(state["out"][0], ref[0], ref[1])
                                                      and torch.equal(state["out"][1], ref[1]))  # fmt: skip
            state["i"] = 0
            per_call = timer(graphed(call, chain)) / chain
        except Exception as e:  # a launch setting that does not compile is reported, not fatal
            r[name] = {"error": str(e)[:300]}
            continue
        r[name] = {"ms": per_call, "same": same}
    # how many of the bf16 planes' pages the int8 codes' selection keeps (first plane set)
    p16, p8, counts = refs[id(planes)][0], refs[id(planes8)][0], refs[id(planes)][1]
    kept = [len(set(p16[i, :c].tolist()) & set(p8[i, :c].tolist())) for i, c in enumerate(counts.tolist()) if c]
    r["int8_pages_kept"] = sum(kept) / max(1, int(counts.sum()))
    print(json.dumps(r), flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--cases", default="1:131072,2:65536,4:32768,16:16384,32:16384,64:4096")
    ap.add_argument("--page-size", type=int, default=32)
    args = ap.parse_args()
    bench_decode_select_gpu.N = args.page_size  # (decode_step reads the module's page size)
    torch.manual_seed(0)
    t0 = time.time()
    timer = Timer(args.reps)
    results = [case(timer, *map(int, c.split(":")), args.chain) for c in args.cases.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_results(out, "quest_select_gpu", "quest, 12.5%", results, triton=triton.__version__,
                  page_size=args.page_size, sms=num_sms(torch.device("cuda")), seconds=round(time.time() - t0, 1),
                  timing="CUDA-graph replays of --chain calls on distinct planes, CUDA events, median of reps, "
                  "L2 flushed before each replay; ms per call")  # fmt: skip


if __name__ == "__main__":
    main()
