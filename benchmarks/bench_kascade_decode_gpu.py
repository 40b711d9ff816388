"""Kascade's decode per layer and over all layers, against dense FlashAttention (issue 13's decode target).

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d 128, bf16, pages of 16), ``B`` requests of
``ctx`` tokens, each layer's decode work captured in a CUDA graph and replayed (what vLLM's full
graphs run), CUDA events, median of reps, L2 flushed before every rep:

* ``anchor_score_ms``: an anchor layer's scoring (``kernels.anchor_mass_decode``: one pass over the
  keys into per-page log-sum-exps, then the pooled mass);
* ``anchor_layer_ms``: a whole anchor layer (scoring, the top-k, attention over the picked pages);
* ``reuse_layer_ms``: a layer that reuses its anchor's pick (identity head map: no selection kernel;
  attention only);
* ``dense_fa_ms``: vLLM's FlashAttention paged decode over every page (what FLASH_ATTN runs);
* ``all_layers_speedup``: ``layers x dense`` over the model's mix at the given anchors (layer 0 dense,
  the other anchors scoring, every other layer reusing), the paper's Table 3 measure.

    python benchmarks/bench_kascade_decode_gpu.py --out DIR [--decode 1:131072,16:16384] [--budget 0.1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import Timer, bench_setup, graphed, write_results  # noqa: E402
from step_breakdown_gpu import HKV, HQ, MAX_MODEL_LEN, SCALE, Cache, D, N  # noqa: E402

from vllm_sparse.backend.dense_prefill import DensePrefill, DenseRows  # noqa: E402
from vllm_sparse.config import SparseConfig  # noqa: E402
from vllm_sparse.decode_step import DecodeColumns  # noqa: E402
from vllm_sparse.kernels.decode_attention import decode_attention_triton  # noqa: E402
from vllm_sparse.selectors import make_selector  # noqa: E402

ANCHORS = [0, 2, 8, 13, 14]  # the Kascade paper's anchors for Llama-3.1-8B (configs/llama-3.1-8b-instruct.yaml)
LAYERS = 32


def case(timer: Timer, dense: DensePrefill, b: int, ctx: int, budget: float, seed: int) -> dict:
    c = Cache("kascade", b, ctx + 1, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    query = torch.randn(b, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    seq = np.full(b, ctx + 1)
    cfg = SparseConfig(method="kascade", sparse_decode=True, budget={"fraction": budget},
                       kascade={"anchors": ANCHORS})  # fmt: skip
    base = make_selector(cfg, SCALE)
    anchor, reuse = base.for_layer(2, LAYERS), base.for_layer(3, LAYERS)
    policy = cfg.for_layer(2)
    assert policy == cfg.for_layer(3)
    step = DecodeColumns([policy], N, b, MAX_MODEL_LEN, "cuda", num_kv_heads=HKV, anchor_scores=True,
                         group_size=HQ // HKV).write(seq, c.block_table)  # fmt: skip
    state = {}

    def attend():
        pages, counts = state["sel"]
        decode_attention_triton(query, c.pk, c.pv, step.block_table, pages, counts, step.columns[policy],
                                c.layout.num_head_slots, SCALE, out)  # fmt: skip

    def score():
        anchor.observe_decode(query, c.pk, c.layout, step)

    def anchor_layer():
        score()
        state["sel"] = anchor.select_decode(query, c.pk, c.layout, None, step, policy)
        attend()

    def reuse_layer():
        state["sel"] = reuse.select_decode(query, c.pk, c.layout, None, step, policy)
        attend()

    rows = DenseRows(
        0, b, torch.arange(b + 1, dtype=torch.int32, device="cuda"),
        torch.full((b,), ctx + 1, dtype=torch.int32, device="cuda"), c.block_table, 1, ctx + 1,
    )  # fmt: skip
    r = {"phase": "decode", "method": "kascade", "batch": b, "context": ctx, "budget": budget}
    r["dense_fa_ms"] = timer(lambda: dense(query, c.k, c.v, rows, SCALE, out))
    r["anchor_score_ms"] = timer(graphed(score))
    r["anchor_layer_ms"] = timer(graphed(anchor_layer))
    anchor_layer()  # the step's pick, which the reuse layers read
    r["reuse_layer_ms"] = timer(graphed(reuse_layer))
    scoring = len([a for a in ANCHORS if a != 0])
    mix = r["dense_fa_ms"] + scoring * r["anchor_layer_ms"] + (LAYERS - 1 - scoring) * r["reuse_layer_ms"]
    r["all_layers_ms"] = mix
    r["all_layers_dense_ms"] = LAYERS * r["dense_fa_ms"]
    r["all_layers_speedup"] = r["all_layers_dense_ms"] / mix
    r["pages_dense"] = -(-(ctx + 1) // N)
    r["pages_selected_mean"] = float(state["sel"][1].float().mean())
    return r


def sweep(timer: Timer, b: int, ctx: int, settings: list[tuple[int, int]], seed: int) -> list[dict]:
    """The anchor scoring alone at each (keys per iteration, warps) of its pass over the keys."""
    from vllm_sparse.kernels.anchor_mass_decode import anchor_decode_mass_triton

    c = Cache("kascade", b, ctx + 1, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    query = torch.randn(b, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    cfg = SparseConfig(method="kascade", sparse_decode=True, kascade={"anchors": ANCHORS})
    cols = DecodeColumns([cfg.for_layer(2)], N, b, MAX_MODEL_LEN, "cuda", num_kv_heads=HKV, anchor_scores=True,
                         group_size=HQ // HKV)  # fmt: skip
    step = cols.write(np.full(b, ctx + 1), c.block_table)
    col = next(iter(step.columns.values()))
    out, want = [], None
    for keys, warps in settings:
        def run(keys=keys, warps=warps):
            anchor_decode_mass_triton(query, c.pk, step.block_table, col, HKV, c.layout.num_head_slots, SCALE,
                                      step.anchor_work, block_keys=keys, num_warps=warps)  # fmt: skip

        run()
        got = step.anchor[:, : ctx // N].clone()
        want = got if want is None else want
        err = float((got - want).abs().max())
        out.append({"batch": b, "context": ctx, "block_keys": keys, "num_warps": warps,
                    "anchor_score_ms": timer(graphed(run)), "max_abs_vs_first": err})  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--decode", default="1:131072,16:16384")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--sweep", default="", help="keys:warps,... of the anchor scoring's pass (scoring only)")
    args = ap.parse_args()
    out, timer, dense = bench_setup(args.out, args.reps, D, N)
    results = []
    settings = [tuple(map(int, s.split(":"))) for s in filter(None, args.sweep.split(","))]
    for seed, spec in enumerate(filter(None, args.decode.split(","))):
        b, ctx = map(int, spec.split(":"))
        results += sweep(timer, b, ctx, settings, seed) if settings else [case(timer, dense, b, ctx, args.budget, seed)]
        print(json.dumps(results[-1]), flush=True)
        torch.cuda.empty_cache()
    write_results(
        out / "kascade_decode_gpu.json",
        "Kascade decode per layer and over all layers, Llama-3.1-8B layer shapes, the paper's anchors",
        "CUDA events, median of reps, L2 flushed before each rep; CUDA-graph replays",
        results,
    )


if __name__ == "__main__":
    main()
