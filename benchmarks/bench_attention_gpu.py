"""Per-layer attention on the GPU: sparse QuoKA (selection + tables + FlashInfer) vs FlashInfer dense.

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d=128, bf16, pages of 16), head-major
cache, the last chunk of a context (``seq_len = context``), one request. Each stage is timed with
CUDA events, after warm-up, with the L2 flushed before every repetition; the median is reported.
Dense and sparse run in the same process on the same cache.

    python benchmarks/bench_attention_gpu.py --out DIR [--contexts 8192,32768,...] [--reps 20]

Writes ``DIR/attention_gpu.json`` and, where matplotlib imports, ``DIR/attention_gpu.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import Timer

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.executors.flashinfer import FlashInferExecutor
from vllm_sparse.kernels.quoka_score import score_pages_triton
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors.base import Selection, past_page_ids
from vllm_sparse.selectors.quoka import QuokaSelector, group_query, subselect_queries
from vllm_sparse.tables import build_page_tables

HQ, HKV, D, N = 32, 8, 128, 16
DTYPE = torch.bfloat16
NUM_QUERIES = 64


def make_case(context: int, chunk: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-context // N)
    num_blocks = pages + 64
    cache = torch.randn(num_blocks, HKV, N, 2 * D, device="cuda", generator=g, dtype=DTYPE)
    block_table = torch.randperm(num_blocks, device="cuda", generator=g)[:pages].to(torch.int32)[None]
    query = torch.randn(chunk, HQ, D, device="cuda", generator=g, dtype=DTYPE)
    return cache, block_table, query


def dense_runner(cache, block_table, query, context, scale, workspace):
    """FlashInfer dense: one request, Hkv=8, Hq=32, over the cache's K/V heads (HND, in place)."""
    import flashinfer

    pages = block_table.shape[1]
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
    last = context - (pages - 1) * N
    w.plan(
        torch.tensor([0, query.shape[0]], dtype=torch.int32),
        torch.tensor([0, pages], dtype=torch.int32),
        block_table[0].clone(),
        torch.tensor([last], dtype=torch.int32),
        num_qo_heads=HQ,
        num_kv_heads=HKV,
        head_dim_qk=D,
        page_size=N,
        causal=True,
        sm_scale=scale,
        q_data_type=DTYPE,
        kv_data_type=DTYPE,
    )
    kv = (cache[..., :D], cache[..., D:])  # [num_blocks, Hkv, N, D] strided views
    return lambda: w.run(query, kv)


class SparseLayer:
    """The sparse pipeline of one layer, stage by stage (QuoKA with the Triton scorer)."""

    def __init__(self, cache, block_table, query, context, budget, scale, executor):
        self.cache, self.block_table, self.query, self.scale = cache, block_table, query, scale
        self.layout = PageLayout.of(cache, HKV, "interleaved")
        policy = LayerPolicy(False, Budget(fraction=budget, min_tokens=0, max_tokens=None), 16, 512, 0)
        self.plan = plan_step(policy, N, [0, query.shape[0]], [context])
        self.req = self.plan.requests[0]
        assert self.req.sparse, "plan is dense"
        self.pk, self.pv = self.layout.page_keys(cache), self.layout.page_values(cache)
        self.ids = past_page_ids(block_table, 0, self.req.num_past_pages, self.layout)
        self.forced = self.req.forced[self.req.forced < self.req.num_past_pages].cuda()
        self.executor = executor
        self.out = torch.empty_like(query)
        self.scores = self.top = self.tables = None
        t0 = time.perf_counter()
        self.score(), self.topk(), self.build_tables()
        self.executor.prepare(self.plan, HKV, HQ // HKV, D, DTYPE, DTYPE, scale, query.device)
        self.selector = QuokaSelector(NUM_QUERIES)
        torch.cuda.synchronize()
        self.plan_ms = (time.perf_counter() - t0) * 1e3

    def queries(self):
        self.qbar = group_query(subselect_queries(self.query, NUM_QUERIES).float(), HKV)

    def score_kernel(self):
        scores = score_pages_triton(self.qbar, self.pk, self.ids)
        scores[:, self.forced] = float("-inf")
        self.scores = scores

    def score(self):
        self.queries(), self.score_kernel()

    def topk(self):
        self.top = torch.topk(self.scores, self.req.num_select, dim=1).indices

    def build_tables(self):
        counts = torch.full((HKV,), self.req.num_select, dtype=torch.int32, device="cuda")
        self.tables = build_page_tables(self.plan, Selection(self.top, counts), self.block_table, self.layout)

    def attend(self):
        self.executor(self.query, self.pk, self.pv, self.tables, self.plan, self.scale, self.out)

    def all(self):
        self.score(), self.topk(), self.build_tables(), self.attend()

    def forward(self):
        """What a layer's forward runs: the selector, the tables, the executor (plan made earlier)."""
        sel = self.selector(self.query, self.pk, self.block_table, self.layout, self.plan)
        tables = build_page_tables(self.plan, sel, self.block_table, self.layout)
        self.executor(self.query, self.pk, self.pv, tables, self.plan, self.scale, self.out)


def versions() -> dict:
    import flashinfer
    import triton

    name = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "gpu": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "flashinfer": flashinfer.__version__,
        "python": platform.python_version(),
    }


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    chunks = sorted({r["chunk"] for r in results})
    fig, axes = plt.subplots(1, len(chunks), figsize=(6 * len(chunks), 4.5), squeeze=False)
    for ax, chunk in zip(axes[0], chunks):
        rows = [r for r in results if r["chunk"] == chunk]
        for budget in sorted({r["budget"] for r in rows}):
            rs = sorted((r for r in rows if r["budget"] == budget), key=lambda r: r["context"])
            ax.plot([r["context"] // 1024 for r in rs], [r["speedup_total"] for r in rs], "o-", label=f"{budget:.2%}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("dense time / sparse time (selection included)")
        ax.set_title(f"last chunk of {chunk} tokens")
        ax.legend(title="budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--contexts", default="8192,32768,65536,131072")
    ap.add_argument("--chunks", default="2048,8192")
    ap.add_argument("--budgets", default="0.0625,0.125,0.25")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timer = Timer(args.reps)
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    executor = FlashInferExecutor()
    scale = D**-0.5
    results = []
    for context in map(int, args.contexts.split(",")):
        for chunk in map(int, args.chunks.split(",")):
            if chunk >= context:
                continue
            cache, block_table, query = make_case(context, chunk, seed=context + chunk)
            dense_ms = timer(dense_runner(cache, block_table, query, context, scale, workspace))
            for budget in map(float, args.budgets.split(",")):
                layer = SparseLayer(cache, block_table, query, context, budget, scale, executor)
                r = {
                    "context": context,
                    "chunk": chunk,
                    "budget": budget,
                    "pages_dense": layer.req.total_pages,
                    "pages_sparse": layer.req.num_pages,
                    "dense_ms": dense_ms,
                    "scoring_ms": timer(layer.score),
                    "scoring_query_subselect_ms": timer(layer.queries),
                    "scoring_page_kernel_ms": timer(layer.score_kernel),
                    "topk_ms": timer(layer.topk),
                    "tables_ms": timer(layer.build_tables),
                    "attention_ms": timer(layer.attend),
                    "sparse_total_ms": timer(layer.all),
                    "forward_ms": timer(layer.forward),
                    "plan_ms_host_once_per_step": layer.plan_ms,
                }
                sel = r["scoring_ms"] + r["topk_ms"] + r["tables_ms"]
                r["selection_share"] = sel / r["sparse_total_ms"]
                r["speedup_attention"] = dense_ms / r["attention_ms"]
                r["speedup_total"] = dense_ms / r["sparse_total_ms"]
                r["speedup_forward"] = dense_ms / r["forward_ms"]
                r["ceiling_pages_ratio"] = r["pages_dense"] / r["pages_sparse"]
                results.append(r)
                print(
                    f"ctx {context:>6} chunk {chunk:>5} budget {budget:6.2%}: dense {dense_ms:7.3f} ms | sparse "
                    f"{r['sparse_total_ms']:7.3f} (score {r['scoring_ms']:.3f} [subsel {r['scoring_query_subselect_ms']:.3f} "
                    f"kernel {r['scoring_page_kernel_ms']:.3f}] topk {r['topk_ms']:.3f} tables "
                    f"{r['tables_ms']:.3f} attn {r['attention_ms']:.3f}) | x{r['speedup_total']:.2f} total, "
                    f"x{r['speedup_attention']:.2f} attn, fwd {r['forward_ms']:.3f} x{r['speedup_forward']:.2f}, ceiling x{r['ceiling_pages_ratio']:.2f}",
                    flush=True,
                )
            del cache, query
            torch.cuda.empty_cache()
    doc = {
        "benchmark": "per-layer attention, last chunk of a context, batch 1",
        "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": N, "dtype": "bfloat16"},
        "method": "CUDA events, 3 warm-ups, median of reps, L2 flushed (512 MiB write) before each rep",
        "notes": "sparse_total_ms times all stages back to back (eager, host launch overhead included); forward_ms times the layer's forward path (QuokaSelector, build_page_tables, executor) with the step's plan made beforehand as the metadata builder does; stage times are timed separately; plan_ms is host time of the once-per-step FlashInfer plan (not in sparse_total_ms)",
        "selector": f"QuoKA, {NUM_QUERIES} queries, sink 16, local 512, Triton query subselection and page scorer, torch.topk",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "versions": versions(),
        "reps": args.reps,
        "results": results,
    }
    (out / "attention_gpu.json").write_text(json.dumps(doc, indent=1))
    plot(results, out / "attention_gpu.png")


if __name__ == "__main__":
    main()
