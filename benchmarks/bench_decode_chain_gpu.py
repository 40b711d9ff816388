"""A decode step's attention work over all layers as one CUDA graph, per way of launching it.

What vLLM's full decode graph replays for a sparse backend, less the model's other kernels: per layer the
step's K/V (and page metadata) write, the selection and the decode attention with its merge. Layer 0 decodes
dense (``serve_bench``'s config), the other layers select at the config's budget. Between layers a bf16 GEMM
of the batch's hidden states (``--filler``: ``[B, 4096] x [4096, F]``, none with 0) stands in for the
projections, so that each chain starts after another kernel, as served. Layers take turns over ``--caches``
caches (each beyond the L2).

Each variant of ``--variants`` (``base``; ``pdl``: programmatic dependent launch of the chain,
``VLLM_SPARSE_PDL=1``) is captured afresh and timed (CUDA events, median of ``--reps`` replays, no L2 flush: the
caches rotate), beside 32 layers of vLLM's FlashAttention decode with the same fillers in one graph (what
FLASH_ATTN's step replays). Each variant's outputs are compared with the first's (bit-equal: only the launch
differs). Session 33 timed three more ways of launching the chain with this script (a fused write, a fused merge,
a counting top-k; ``benchmarks/results/gpu_session33/``), none faster than these kernels.

    python benchmarks/bench_decode_chain_gpu.py --out DIR [--method quest] [--decode 16:16384,1:131072] \
        [--variants base,pdl] [--page-size 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_breakdown_gpu  # noqa: E402
from gpu_timing import Timer, bench_setup, graphed, write_results  # noqa: E402
from step_breakdown_gpu import HKV, HQ, MAX_MODEL_LEN, SCALE, Cache, D, N  # noqa: E402

from vllm_sparse.backend.dense_prefill import DensePrefill, DenseRows  # noqa: E402
from vllm_sparse.config import SparseConfig  # noqa: E402
from vllm_sparse.decode_step import DecodeColumns  # noqa: E402
from vllm_sparse.kernels import pdl  # noqa: E402
from vllm_sparse.kernels.decode_attention import decode_attention_triton  # noqa: E402
from vllm_sparse.kernels.kv_write import write_decode_step_triton  # noqa: E402
from vllm_sparse.selectors import make_selector  # noqa: E402

LAYERS = 32
HIDDEN = 4096


class Layer:
    """One layer's decode on one cache: its new token's K/V, its query, output and decode columns."""

    def __init__(self, method: str, b: int, ctx: int, budget: float, seed: int):
        self.c = c = Cache(method, b, ctx + 1, seed)
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        self.query = torch.randn(b, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
        self.key = torch.randn(b, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
        self.value = torch.randn(b, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.query)
        self.slots = (c.block_table[:, ctx // N].long() * N + ctx % N).contiguous()  # the step's token
        cfg = SparseConfig(method=method, sparse_decode=True, budget={"fraction": budget})
        self.dense_policy, self.policy = cfg.for_layer(0), cfg.for_layer(1)
        self.selector = make_selector(cfg, SCALE)
        seq = np.full(b, ctx + 1)
        cols = DecodeColumns([self.dense_policy, self.policy], N, b, MAX_MODEL_LEN, "cuda", num_kv_heads=HKV)
        self.step = cols.write(seq, c.block_table)
        self.rows = DenseRows(
            0, b, torch.arange(b + 1, dtype=torch.int32, device="cuda"),
            torch.full((b,), ctx + 1, dtype=torch.int32, device="cuda"), c.block_table, 1, ctx + 1,
        )  # fmt: skip

    def sparse(self, dense_layer: bool) -> None:
        """The layer's chain: write, selection (none for a dense layer), attention and merge."""
        c, step = self.c, self.step
        policy = self.dense_policy if dense_layer else self.policy
        write_decode_step_triton(c.layout, c.cache, c.meta, self.key, self.value, self.slots)
        pages, counts = step.no_pages, step.no_counts
        if not dense_layer:
            pages, counts = self.selector.select_decode(self.query, c.pk, c.layout, c.meta, step, policy)
        decode_attention_triton(self.query, c.pk, c.pv, step.block_table, pages, counts, step.columns[policy],
                                c.layout.num_head_slots, SCALE, self.out)  # fmt: skip

    def flash(self, dense: DensePrefill) -> None:
        """FLASH_ATTN's layer: vLLM's FlashAttention decode over every page (the K/V write left out)."""
        dense(self.query, self.c.k, self.c.v, self.rows, SCALE, self.out)


VARIANTS = {"base": "0", "pdl": "1"}  # variant -> VLLM_SPARSE_PDL


def chain_graph(layers: list[Layer], filler) -> callable:
    """The sparse step: ``LAYERS`` chains, each after a filler GEMM, layer ``i`` on ``layers[i % len]``."""

    def step():
        for i in range(LAYERS):
            filler()
            layers[i % len(layers)].sparse(dense_layer=i == 0)

    return graphed(step)


def case(timer: Timer, dense: DensePrefill, method: str, b: int, ctx: int, budget: float, variants: list[str],
         caches: int, filler_cols: int, seed: int) -> dict:  # fmt: skip
    layers = [Layer(method, b, ctx, budget, seed + 100 * i) for i in range(caches)]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, max(filler_cols, 1), device="cuda", generator=g, dtype=torch.bfloat16)
    y = torch.empty(b, max(filler_cols, 1), device="cuda", dtype=torch.bfloat16)

    def filler():
        if filler_cols:
            torch.mm(x, w, out=y)

    r = {"method": method, "batch": b, "context": ctx, "budget": budget, "page_size": N, "caches": caches,
         "filler": f"[{b}, {HIDDEN}] x [{HIDDEN}, {filler_cols}]" if filler_cols else None, "variants": {}}  # fmt: skip

    def flash_step():
        for i in range(LAYERS):
            filler()
            layers[i % len(layers)].flash(dense)

    r["flash_attn_ms"] = timer(graphed(flash_step))
    r["fillers_ms"] = timer(graphed(lambda: [filler() for _ in range(LAYERS)])) if filler_cols else 0.0
    saved = os.environ.get(pdl.ENV)
    reference = None
    try:
        for name in variants:
            os.environ[pdl.ENV] = VARIANTS[name]
            replay = chain_graph(layers, filler)
            ms = timer(replay)
            replay()
            torch.cuda.synchronize()
            outs = torch.stack([layer.out for layer in layers]).float()
            if reference is None:
                reference = outs.clone()
            r["variants"][name] = {
                "ms": ms,
                "layer_us": (ms - r["fillers_ms"]) * 1e3 / LAYERS,  # mean of the 32 chains, fillers taken off
                "vs_flash_attn": r["flash_attn_ms"] / ms,
                "max_abs_diff_vs_first": float((outs - reference).abs().max()),
                "use_pdl": pdl.pdl_enabled(torch.device("cuda")),
            }
            print(json.dumps({"batch": b, "context": ctx, "variant": name, **r["variants"][name]}), flush=True)
            del replay
    finally:
        if saved is None:
            os.environ.pop(pdl.ENV, None)
        else:
            os.environ[pdl.ENV] = saved
    return r


def main() -> None:
    global N
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", default="quest")
    ap.add_argument("--decode", default="16:16384,1:131072", help="batch:context,...")
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument(
        "--variants", default="base,pdl", help=f"chains to time ({', '.join(VARIANTS)}), the first the reference"
    )
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--caches", type=int, default=4)
    ap.add_argument("--filler", type=int, default=6144, help="columns of the GEMM between layers (0: none)")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    N = step_breakdown_gpu.N = args.page_size  # (the cache of step_breakdown_gpu.Cache too)
    variants = [m for m in args.variants.split(",") if m]
    for m in variants:
        if m not in VARIANTS:
            raise SystemExit(f"--variants: {m!r} is not one of {sorted(VARIANTS)}")
    out, _, dense = bench_setup(args.out, args.reps, D, N)
    timer = Timer(args.reps, flush="none")
    results = []
    for seed, spec in enumerate(filter(None, args.decode.split(","))):
        b, ctx = map(int, spec.split(":"))
        results.append(case(timer, dense, args.method, b, ctx, args.budget, variants, args.caches, args.filler, seed))
        torch.cuda.empty_cache()
    write_results(
        out / f"decode_chain_{args.method}_pages{N}.json",
        "A decode step's attention chain over 32 layers in one CUDA graph per variant, against FlashAttention",
        args.method,
        results,
        timing="CUDA events, median of reps, no L2 flush (the layers rotate over caches); CUDA-graph replays",
    )


if __name__ == "__main__":
    main()
