"""Kascade's anchor scoring per layer on the CPU: the native kernel (``csrc/kascade_cpu.cpp``) vs its torch twin.

    python benchmarks/bench_kascade_cpu.py [--contexts 8192 16384 32768] [--chunks 2048 1] [--reps 5]

The last chunk of a context of length ``ctx`` (or a decode step: a chunk of 1), one request, Qwen2.5-0.5B
layer shapes by default (14 query heads, 2 KV heads, d=64), a bf16 cache in the CPU engine's layout
(``planes``: keys channel-major in each page), 32-token pages, tiles of 32
queries: ``anchor_page_mass`` (torch) against ``cpu_native.anchor_page_mass``, same inputs, and the
largest relative difference between them. Median of ``--reps`` after one warm-up; the JSON records
the CPU, the thread count and the load average at start and end (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from cpu_timing import cpu_model, timed

from vllm_sparse.kernels import cpu_native
from vllm_sparse.kernels.anchor_mass import TILE, anchor_page_mass
from vllm_sparse.layout import PageLayout

OUT = Path(__file__).parent / "results" / "kascade_cpu_native.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--chunks", type=int, nargs="+", default=[2048, 1])
    p.add_argument("--heads", type=int, nargs=2, default=[14, 2], metavar=("HQ", "HKV"))
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if not cpu_native.available():
        sys.exit(f"native CPU kernels unavailable: {cpu_native._state.get('reason')}")
    hq, hkv = args.heads
    d, n = args.head_size, args.page_size
    load_start = os.getloadavg()
    rows = []
    for ctx in args.contexts:
        for c in args.chunks:
            g = torch.Generator().manual_seed(ctx + c)
            pages = -(-(ctx + c) // n)
            kv = torch.randn(pages + 4, hkv, n, 2 * d, generator=g).to(torch.bfloat16)
            layout = PageLayout.of(kv, hkv, "planes")  # the CPU engine's in-page order
            page_keys = layout.page_keys(kv)
            blocks = torch.randperm(pages + 4, generator=g)[:pages]
            ids = layout.page_ids(blocks[None, :], torch.arange(hkv)[:, None])  # [Hkv, pages]
            q = torch.randn(c, hq, d, generator=g).to(torch.bfloat16)
            scale = d**-0.5
            want = anchor_page_mass(q, page_keys, ids, ctx, scale, TILE)
            got = cpu_native.anchor_page_mass(q, page_keys, ids, ctx, scale, TILE)
            rel = float(((got - want).abs() / want.abs().clamp_min(1e-12)).max())
            torch_ms = timed(lambda: anchor_page_mass(q, page_keys, ids, ctx, scale, TILE), args.reps)
            native_ms = timed(lambda: cpu_native.anchor_page_mass(q, page_keys, ids, ctx, scale, TILE), args.reps)
            row = dict(context=ctx, chunk=c, torch_ms=round(torch_ms, 3), native_ms=round(native_ms, 3),
                       speedup=round(torch_ms / native_ms, 2), max_rel_diff=rel)  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    doc = dict(
        what="Kascade anchor scoring of one layer (anchor_page_mass), torch twin vs native CPU kernel",
        command="python " + " ".join(sys.argv),
        cpu=cpu_model(), threads=torch.get_num_threads(), torch=torch.__version__,
        shapes=dict(query_heads=hq, kv_heads=hkv, head_size=d, page_size=n, tile=TILE, dtype="bfloat16"),
        load_average_start=load_start, load_average_end=os.getloadavg(), rows=rows,
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
