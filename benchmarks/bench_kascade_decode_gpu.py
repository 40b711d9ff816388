"""Kascade's decode per layer and over all layers, against dense FlashAttention (issue 13's decode target).

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d 128, bf16, pages of ``--page-size``, default 16), ``B`` requests of
``ctx`` tokens, each layer's decode work captured in a CUDA graph and replayed (what vLLM's full
graphs run), CUDA events, median of reps, L2 flushed before every rep:

* ``anchor_score_ms``: an anchor layer's scoring (``kernels.anchor_mass_decode``: one pass over the
  keys into per-page log-sum-exps, then the pooled mass);
* ``anchor_layer_ms``: a whole anchor layer (scoring, the top-k, attention over the picked pages);
* ``reuse_layer_ms``: a layer that reuses its anchor's pick (identity head map: no selection kernel;
  attention only);
* ``dense_fa_ms``: vLLM's FlashAttention paged decode over every page (what FLASH_ATTN runs);
* ``all_layers_speedup``: ``layers x dense`` over the model's mix at the given anchors (layer 0 dense,
  the other anchors scoring, every other layer reusing), the paper's Table 3 measure, summed from the
  per-layer replays above (each of which pays a graph launch and a cold L2);
* ``model_graph_speedup``: the same mix captured as one graph of all 32 layers back to back (what
  vLLM's full decode graph replays) against 32 dense layers in one graph, the layers taking turns
  over ``--caches`` caches (each beyond the L2, so no layer reads the previous one's bytes from it).

    python benchmarks/bench_kascade_decode_gpu.py --out DIR [--decode 1:131072,16:16384] [--budget 0.1] [--page-size 32]
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

import step_breakdown_gpu  # noqa: E402
from gpu_timing import Timer, bench_setup, graphed, write_results  # noqa: E402
from step_breakdown_gpu import HKV, HQ, MAX_MODEL_LEN, SCALE, Cache, D, N  # noqa: E402

from vllm_sparse.backend.dense_prefill import DensePrefill, DenseRows  # noqa: E402
from vllm_sparse.config import SparseConfig  # noqa: E402
from vllm_sparse.decode_step import DecodeColumns  # noqa: E402
from vllm_sparse.kernels.decode_attention import decode_attention_triton  # noqa: E402
from vllm_sparse.selectors import make_selector  # noqa: E402

ANCHORS = [0, 2, 8, 13, 14]  # the Kascade paper's anchors for Llama-3.1-8B (configs/llama-3.1-8b-instruct.yaml)
LAYERS = 32


class LayerFns:
    """One layer's decode work on one cache (``Cache``) and its own query: ``dense``, ``score``,
    ``anchor_layer`` and ``reuse_layer`` (see the module docstring), each a callable."""

    def __init__(self, dense: DensePrefill, b: int, ctx: int, budget: float, seed: int):
        self.c = c = Cache("kascade", b, ctx + 1, seed)
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        self.query = query = torch.randn(b, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
        self.out = out = torch.empty_like(query)
        cfg = SparseConfig(method="kascade", sparse_decode=True, budget={"fraction": budget},
                           kascade={"anchors": ANCHORS})  # fmt: skip
        base = make_selector(cfg, SCALE)
        self._anchor, self._reuse = base.for_layer(2, LAYERS), base.for_layer(3, LAYERS)
        self.policy = policy = cfg.for_layer(2)
        assert policy == cfg.for_layer(3)
        self.step = DecodeColumns([policy], N, b, MAX_MODEL_LEN, "cuda", num_kv_heads=HKV, anchor_scores=True,
                                  group_size=HQ // HKV).write(np.full(b, ctx + 1), c.block_table)  # fmt: skip
        self.sel = None
        rows = DenseRows(
            0, b, torch.arange(b + 1, dtype=torch.int32, device="cuda"),
            torch.full((b,), ctx + 1, dtype=torch.int32, device="cuda"), c.block_table, 1, ctx + 1,
        )  # fmt: skip
        self.dense = lambda: dense(query, c.k, c.v, rows, SCALE, out)

    def attend(self):
        pages, counts = self.sel
        c = self.c
        decode_attention_triton(self.query, c.pk, c.pv, self.step.block_table, pages, counts,
                                self.step.columns[self.policy], c.layout.num_head_slots, SCALE, self.out)  # fmt: skip

    def score(self):
        self._anchor.observe_decode(self.query, self.c.pk, self.c.layout, self.step)

    def anchor_layer(self):
        self.score()
        self.sel = self._anchor.select_decode(self.query, self.c.pk, self.c.layout, None, self.step, self.policy)
        self.attend()

    def reuse_layer(self):
        self.sel = self._reuse.select_decode(self.query, self.c.pk, self.c.layout, None, self.step, self.policy)
        self.attend()


def model_graphs(layers: list[LayerFns]) -> tuple:
    """``(sparse, dense)``: graph replays of the whole model's decode attention, layer after layer as
    vLLM's full graph runs them (layer 0 dense, the other anchors scoring, every other layer reusing;
    against 32 dense layers), layer ``i`` on ``layers[i % len(layers)]``: with a few caches, each
    larger than the L2, no layer finds the last one's bytes there."""
    for fns in layers:
        fns.anchor_layer()  # each cache's pick, which its reuse layers read
    torch.cuda.synchronize()
    # every pick a captured layer reads stays allocated while the graph lives: a reuse layer captured
    # before its cache's next anchor reads the pick that the anchor then replaces on the host
    picks = []

    def sparse():
        for i in range(LAYERS):
            fns = layers[i % len(layers)]
            if i == 0:
                fns.dense()
            elif i in ANCHORS:
                fns.anchor_layer()
            else:
                fns.reuse_layer()
            picks.append(fns.sel)

    def dense():
        for i in range(LAYERS):
            layers[i % len(layers)].dense()

    sparse_replay = graphed(sparse)

    def replay_sparse(_picks=picks):  # (holds the picks as long as the replay is held)
        sparse_replay()

    return replay_sparse, graphed(dense)


def case(timer: Timer, dense: DensePrefill, b: int, ctx: int, budget: float, seed: int, caches: int = 4) -> dict:
    fns = LayerFns(dense, b, ctx, budget, seed)
    r = {"phase": "decode", "method": "kascade", "batch": b, "context": ctx, "budget": budget, "page_size": N}
    r["dense_fa_ms"] = timer(fns.dense)
    r["anchor_score_ms"] = timer(graphed(fns.score))
    r["anchor_layer_ms"] = timer(graphed(fns.anchor_layer))
    fns.anchor_layer()  # the step's pick, which the reuse layers read
    r["reuse_layer_ms"] = timer(graphed(fns.reuse_layer))
    scoring = len([a for a in ANCHORS if a != 0])
    mix = r["dense_fa_ms"] + scoring * r["anchor_layer_ms"] + (LAYERS - 1 - scoring) * r["reuse_layer_ms"]
    r["all_layers_ms"] = mix
    r["all_layers_dense_ms"] = LAYERS * r["dense_fa_ms"]
    r["all_layers_speedup"] = r["all_layers_dense_ms"] / mix
    r["pages_dense"] = -(-(ctx + 1) // N)
    r["pages_selected_mean"] = float(fns.sel[1].float().mean())
    if caches:  # the whole model's decode attention in one graph each, as served
        layers = [fns] + [LayerFns(dense, b, ctx, budget, seed + 100 + i) for i in range(caches - 1)]
        sparse_graph, dense_graph = model_graphs(layers)
        r["model_graph_caches"] = caches
        r["model_graph_ms"] = timer(sparse_graph)
        r["model_graph_dense_ms"] = timer(dense_graph)
        r["model_graph_speedup"] = r["model_graph_dense_ms"] / r["model_graph_ms"]
        del layers, sparse_graph, dense_graph
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
    global N
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--decode", default="1:131072,16:16384")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--sweep", default="", help="keys:warps,... of the anchor scoring's pass (scoring only)")
    ap.add_argument("--page-size", type=int, default=N, help="tokens per page (vLLM's default block size is 16)")
    ap.add_argument("--caches", type=int, default=4, help="caches of the whole-model graphs (0: no such graphs)")
    args = ap.parse_args()
    N = step_breakdown_gpu.N = args.page_size  # (the cache of step_breakdown_gpu.Cache too)
    out, timer, dense = bench_setup(args.out, args.reps, D, N)
    results = []
    settings = [tuple(map(int, s.split(":"))) for s in filter(None, args.sweep.split(","))]
    for seed, spec in enumerate(filter(None, args.decode.split(","))):
        b, ctx = map(int, spec.split(":"))
        results += (
            sweep(timer, b, ctx, settings, seed)
            if settings
            else [case(timer, dense, b, ctx, args.budget, seed, args.caches)]
        )
        print(json.dumps(results[-1]), flush=True)
        torch.cuda.empty_cache()
    write_results(
        out / f"kascade_decode_gpu_pages{N}.json",
        "Kascade decode per layer and over all layers, Llama-3.1-8B layer shapes, the paper's anchors",
        "CUDA events, median of reps, L2 flushed before each rep; CUDA-graph replays",
        results,
    )


if __name__ == "__main__":
    main()
