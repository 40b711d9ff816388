"""Kascade's prefill anchor scoring on one layer, against dense FlashAttention on the same chunk.

What Kascade's TTFT pays at its anchor layers: the exact pooled post-softmax mass of every past page
(``kernels.anchor_mass``: pass 1 the log-sum-exp of every (query, head) row, pass 2 the mass per
page), beside vLLM's FlashAttention over the same chunk and cache (the FLASH_ATTN kernel, what a dense
layer costs). Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d 128, bf16, pages of 16), one
chunk of ``q`` queries after ``ctx`` past tokens, CUDA events, median of reps, L2 flushed before
every rep. Settings swept: ``steps`` (key blocks per pass-2 program) and ``num_warps``; then, at the
first setting, each ``kascade.tile_stride`` of ``--strides`` (the chunk's last tile and every S-th
before it scored: ``anchor_ms_stride{S}``).

    python benchmarks/bench_anchor_mass_gpu.py --out DIR [--contexts 16384,65536,122880] [--q 8192] [--strides 4,8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import Timer, bench_setup, write_results  # noqa: E402
from step_breakdown_gpu import HKV, HQ, SCALE, Cache, D, N  # noqa: E402

from vllm_sparse.backend.dense_prefill import DensePrefill, DenseRows  # noqa: E402
from vllm_sparse.kernels.anchor_mass import anchor_page_mass_triton  # noqa: E402
from vllm_sparse.selectors.base import past_page_ids  # noqa: E402


def case(timer: Timer, dense: DensePrefill, q: int, ctx: int, settings: list[tuple[int, int]], seed: int,
         strides: list[int] = ()) -> dict:  # fmt: skip
    c = Cache("kascade", 1, ctx + q, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    query = torch.randn(q, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    rows = DenseRows(
        0, q, torch.tensor([0, q], dtype=torch.int32, device="cuda"),
        torch.tensor([ctx + q], dtype=torch.int32, device="cuda"), c.block_table, q, ctx + q,
    )  # fmt: skip
    r = {"query_len": q, "context": ctx, "dense_fa_ms": timer(lambda: dense(query, c.k, c.v, rows, SCALE, out))}
    ids = past_page_ids(c.block_table, 0, -(-(ctx + q - 1) // N), c.layout)
    ref = None
    for steps, warps in settings:
        fn = lambda: anchor_page_mass_triton(query, c.pk, ids, ctx, SCALE, steps=steps, num_warps=warps)  # noqa: E731
        mass = fn()
        ref = mass if ref is None else ref
        torch.testing.assert_close(mass, ref, rtol=1e-3, atol=1e-6)  # every setting computes the same
        r[f"anchor_ms_steps{steps}_warps{warps}"] = timer(fn)
    steps, warps = settings[0]
    for stride in strides:
        fn = lambda: anchor_page_mass_triton(query, c.pk, ids, ctx, SCALE, stride=stride, steps=steps, num_warps=warps)  # noqa: E731
        r[f"anchor_ms_stride{stride}"] = timer(fn)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--q", type=int, default=8192)
    ap.add_argument("--contexts", default="16384,65536,122880")
    ap.add_argument("--settings", default="1:4,16:4,64:4,16:8", help="steps:num_warps pairs")
    ap.add_argument("--strides", default="", help="kascade.tile_stride values, at the first setting")
    args = ap.parse_args()
    out, timer, dense = bench_setup(args.out, args.reps, D, N)
    settings = [tuple(map(int, s.split(":"))) for s in args.settings.split(",")]
    strides = [int(x) for x in args.strides.split(",") if x]
    results = []
    for i, ctx in enumerate(map(int, args.contexts.split(","))):
        r = case(timer, dense, args.q, ctx, settings, seed=i, strides=strides)
        results.append(r)
        print(json.dumps(r), flush=True)
        write_results(
            out / "anchor_mass_gpu.json",
            "Kascade prefill anchor scoring (two passes) vs FlashAttention, one layer, Llama-3.1-8B shapes",
            "CUDA events, median of reps, L2 flushed before each rep",
            results,
            hkv=HKV,
        )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
