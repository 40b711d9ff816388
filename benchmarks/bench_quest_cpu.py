"""Quest selection per layer on the CPU: native bounds kernel (``csrc/quest_cpu.cpp``) vs torch.

    python benchmarks/bench_quest_cpu.py [--contexts 8192 16384 32768] [--chunks 2048 1] [--reps 7]

The last chunk of a context of length ``ctx`` (or a decode step), one request, Qwen2.5-0.5B layer
shapes by default (14 query heads, 2 KV heads, d=64), bf16 cache, 32-token pages, page min/max
planes written by ``metadata.page_minmax``. ``select_*`` is the whole ``QuestSelector`` call (bounds,
GQA ``max`` reduction, top-k), ``bounds_*`` the bounds stage alone; ``*_torch`` runs inside
``cpu_native.torch_path()``. Median of ``--reps`` after one warm-up; the JSON records the CPU, the
thread count and the load average at start and end (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from cpu_timing import cpu_model, timed

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.kernels import cpu_native
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors.quest import QuestSelector, _bounds, _decode_bounds


def bench_case(ctx, chunk, fraction, hq, hkv, d, n, reps) -> dict:
    g = torch.Generator().manual_seed(ctx + chunk)
    dtype = torch.bfloat16
    planes = MetaPlanes.for_method("quest", hkv, n, d, dtype)
    num_pages = -(-ctx // n)
    kv = torch.randn(num_pages + 1, hkv + planes.num_slots, n, 2 * d, generator=g).to(dtype)
    layout = PageLayout.of(kv, hkv, "planes")
    meta = planes.views(kv)
    block_table = torch.randperm(num_pages + 1, generator=g)[:num_pages].to(torch.int32)[None]
    slots = block_table[0, torch.arange(ctx) // n].long() * n + torch.arange(ctx) % n
    write_page_minmax(layout, kv, meta, slots)
    query = torch.randn(chunk, hq, d, generator=g).to(dtype)
    policy = LayerPolicy(False, Budget(fraction=fraction, min_tokens=0, max_tokens=None), 16, 512, 0)
    plan = plan_step(policy, n, [0, chunk], [ctx])
    req = plan.requests[0]
    selector, pk = QuestSelector(), layout.page_keys(kv)
    state = {}

    def select():
        state["sel"] = selector(query, pk, block_table, layout, plan, meta)

    if chunk == 1:
        batch = plan.state.on(block_table, layout).decode

        def bounds():
            state["u"] = _decode_bounds(query, meta, batch)
    else:
        blocks = block_table[0, : req.num_past_pages].long()

        def bounds():
            state["u"] = _bounds(query, meta, blocks)

    def torch_path(fn):
        def run():
            with cpu_native.torch_path():
                fn()

        return run

    row = {
        "context": ctx,
        "chunk": chunk,
        "budget_fraction": fraction,
        "num_past_pages": req.num_past_pages,
        "num_select": req.num_select,
    }
    row["bounds_torch_ms"] = timed(torch_path(bounds), reps)
    row["select_torch_ms"] = timed(torch_path(select), reps)
    u_torch, sel_torch = state["u"], state["sel"]
    if cpu_native.available():
        row["bounds_native_ms"] = timed(bounds, reps)
        row["select_native_ms"] = timed(select, reps)
        row["bounds_max_abs_diff"] = float((state["u"] - u_torch).abs().max())
        a, b = sel_torch.indices[:, : req.num_select], state["sel"].indices[:, : req.num_select]
        same = [len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)]
        row["same_pages"] = sum(same) / max(1, req.num_select * hkv)  # < 1 only through near-ties
        row["bounds_speedup"] = row["bounds_torch_ms"] / row["bounds_native_ms"]
        row["select_speedup"] = row["select_torch_ms"] / row["select_native_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--chunks", type=int, nargs="+", default=[2048, 1])
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--page", type=int, default=32)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1], help="torch threads, each in turn")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "quest_cpu_native.json"))
    args = p.parse_args()
    load_start = os.getloadavg()
    hq, hkv, d = 14, 2, 64
    native = cpu_native.available()  # builds the library first if needed (not timed)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for ctx in args.contexts:
            for chunk in args.chunks:
                r = {"threads": threads, **bench_case(ctx, chunk, args.budget, hq, hkv, d, args.page, args.reps)}
                rows.append(r)
                print(
                    f"threads {threads} ctx {ctx:6d} chunk {chunk:5d}: select torch {r['select_torch_ms']:.2f} ms native "
                    f"{r.get('select_native_ms', float('nan')):.2f} ms | bounds torch {r['bounds_torch_ms']:.2f} ms "
                    f"native {r.get('bounds_native_ms', float('nan')):.2f} ms",
                    flush=True,
                )
    ops_ns = cpu_native.load()
    out = {
        "command": "python " + " ".join(sys.argv),
        "machine": {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
        },
        "shape": {
            "name": "qwen0.5b",
            "q_heads": hq,
            "kv_heads": hkv,
            "head_dim": d,
            "page": args.page,
            "dtype": "bfloat16",
            "gqa_reduce": "max",
        },
        "native": {
            "available": native,
            "avx512": bool(ops_ns.has_avx512()) if ops_ns is not None else None,
            "reason": cpu_native._state.get("reason"),
        },
        "versions": {"torch": torch.__version__},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
