"""GPU sweep of the decode attention kernel's tile and launch settings, against FlashAttention's
dense decode over the same rows' whole context (the bandwidth it reaches is the bar).

``kernels.decode_attention`` streams each (request, KV head) row's selected and forced pages; at
16 requests of 16K it reached about 2.0 TB/s where vLLM's FlashAttention reads the whole context at
2.85 TB/s. This sweep times every combination of tokens per tile (``block_n``), warps, pipeline
stages and programs per SM (``splits``; the ``splits`` grid: 1-3 splits per row exactly) on the pages a 1/8 (Quest) and a 1/4 (Twilight's candidates) selection attends, so
the defaults can follow the measurement.

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d 128, bf16, pages of 16 or ``--page-size``; ``--heads 12:2``
for Qwen2.5-Coder-1.5B's). Every case is
captured in a CUDA graph and its replays timed with CUDA events (median of ``--reps``, L2 flushed
before each, ``gpu_timing.Timer``).

    python benchmarks/bench_decode_attention_tuning_gpu.py --out FILE [--reps 30] [--grid launch|default]
        [--page-size 32] [--selection random|first] [--flush write|read|none] [--chain 16]
        (--grid: launch, wide, default, per_sm or splits)

Beside the sweep, vLLM's FlashAttention (FA3) runs the same sparse rows as paged sequences of
one KV head (``flash_attn_sparse_rows_splits*``): what a decode path through FlashAttention
would read at.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_decode_select_gpu
from bench_decode_select_gpu import decode_step
from gpu_timing import FLUSH_MODES, Timer, graphed

from vllm_sparse.kernels.decode_attention import BLOCK_N, decode_attention_triton, num_splits
from vllm_sparse.kernels.page_topk import select_top_pages_triton
from vllm_sparse.kernels.paged_attention import num_sms
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import HEAD, LAST, SELECT, TAIL, TOTAL

HQ, HKV, D, N = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = D**-0.5
CASES = [(1, 131072, 0.125), (16, 16384, 0.125), (16, 16384, 0.25), (64, 4096, 0.25)]  # (batch, context, fraction)
# grids: name -> (block_n, warps, stages, programs per SM) values swept ("default": the serving settings)
GRIDS = {
    "launch": ([32, 64, 128], [2, 4, 8], [2, 3, 4], [1, 2, 4]),
    "wide": ([64, 128], [4, 8], [2, 3, 4], [1, 2, 4, 8]),  # long dense rows: larger tiles, more programs
    "default": ([BLOCK_N], [4], [3], [2]),
    # serving's tile and launch with 1, 2 and 4 programs per SM (4: what ``num_splits`` takes for at most 32 rows)
    "per_sm": ([BLOCK_N], [4], [3], [1, 2, 4]),
    # a negative count is that many splits per row exactly, whatever the rows (session 27 ran it with a variant whose
    # single split wrote the output without the merge, not kept: gpu_session27/README.md)
    "splits": ([64, 128], [4, 8], [3], [-1, -2, -3]),
}


def compiled_variants(kernel) -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of a Triton kernel (what decides how many of
    its programs an SM holds at once: ``resident_per_sm``); empty where this Triton keeps them elsewhere."""
    out = []
    try:
        for cache in kernel.device_caches.values():
            for compiled in cache[0].values():
                out.append({"n_regs": compiled.n_regs, "n_spills": compiled.n_spills,
                            "shared": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps})  # fmt: skip
    except Exception:  # noqa: BLE001 - a Triton without this layout: the timings stand without it
        pass
    return out


def resident_per_sm(n_regs: int, shared: int, num_warps: int, device: torch.device) -> int:
    """Programs of one kernel an SM holds at once, from its registers and shared memory (65,536 registers an SM)."""
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_regs = 65536 // max(1, n_regs * 32 * num_warps)
    return min(by_regs, smem // max(1, shared + 1024), 32)


def layer_cycle(items: list):
    """A function returning ``items`` in turn: the calls captured back to back in one graph
    (``--chain``) read one cache each, as consecutive layers of a model do, not one cache from L2."""
    it = itertools.cycle(items)
    return lambda: next(it)


def flash_dense_ms(timer, caches, table, batch: int, context: int) -> float | None:
    """vLLM's FlashAttention decode over the whole context of the same rows (``None`` without it),
    one call per cache of ``caches`` captured back to back, time per call."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    # [blocks, N, Hkv, D] views of the head-major caches
    kv = layer_cycle([(c[..., :D].transpose(1, 2), c[..., D:].transpose(1, 2)) for c in caches])
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seqused = torch.full((batch,), context + 1, device="cuda", dtype=torch.int32)

    def run():
        k, v = kv()
        flash_attn_varlen_func(q, k, v, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=context + 1,
                               seqused_k=seqused, block_table=table, softmax_scale=SCALE, causal=True, fa_version=3)  # fmt: skip

    try:
        return timer(graphed(run, len(caches))) / len(caches)
    except Exception as e:  # noqa: BLE001 - strided K/V may be refused; the sweep stands without it
        print(f"flash_attn dense decode not timed: {e}", file=sys.stderr)
        return None


def sparse_rows_table(step, cols, sel, counts, head_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (request, KV head) row's pages as one FlashAttention sequence over the cache viewed as
    one-head pages: ``(table int32 [rows, max_pages], kv_lens int32 [rows])``, the row's selected
    pages, then its sink and local pages (the last page last), as the decode kernel compacts them."""
    bt, c = step.block_table.long().cpu(), cols.cpu()
    sel, counts = sel.long().cpu(), counts.cpu()
    rows_pages, lens = [], []
    for r in range(sel.shape[0]):
        req, kv = divmod(r, HKV)
        head, tail, total, last = (int(c[req, i]) for i in (HEAD, TAIL, TOTAL, LAST))
        logical = torch.cat([sel[r, : int(counts[r])], torch.arange(head), torch.arange(tail, total)])
        rows_pages.append(bt[req, logical] * head_slots + kv)
        lens.append((logical.numel() - 1) * N + last)
    table = torch.zeros(len(rows_pages), max(len(x) for x in rows_pages), dtype=torch.int32)
    for r, x in enumerate(rows_pages):
        table[r, : len(x)] = x.int()
    return table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def flash_sparse_rows(timer, views, query, table, kv_lens, splits: int) -> tuple[float, torch.Tensor] | None:
    """vLLM's FlashAttention (FA3) decode over the same sparse rows (each row a sequence of one KV
    head and the G query heads of its group), ``num_splits`` fixed as a CUDA graph needs; ``None``
    without it. ``views``: ``(page_keys, page_values)`` per cache, one call each captured back to back.
    Returns its time per call and the output ``[B, Hq, D]`` of the first cache's."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    rows = table.shape[0]
    q = query.view(rows, HQ // HKV, D)
    out = torch.empty_like(q)
    cu_q = torch.arange(rows + 1, device="cuda", dtype=torch.int32)

    kv = layer_cycle(views)

    def run():
        pk, pv = kv()
        flash_attn_varlen_func(q=q, k=pk.unsqueeze(2), v=pv.unsqueeze(2), out=out, max_seqlen_q=1, cu_seqlens_q=cu_q,
                               max_seqlen_k=table.shape[1] * N, seqused_k=kv_lens, block_table=table,
                               softmax_scale=SCALE, causal=True, num_splits=splits, fa_version=3)  # fmt: skip

    try:
        return timer(graphed(run, len(views))) / len(views), out.view(query.shape)
    except Exception as e:  # noqa: BLE001
        print(f"flash_attn sparse rows not timed: {e}", file=sys.stderr)
        return None


def case(
    timer, batch: int, context: int, fraction: float, grid: str, selection: str = "random", chain: int = 1,
    exact_splits: list[int] | None = None,
) -> dict:
    policy, step, num_blocks = decode_step(batch, context, fraction, ordered=selection == "first")
    cols = step.columns[policy]
    rows = batch * HKV
    caches = [torch.randn(num_blocks, HKV, N, 2 * D, device="cuda", dtype=DTYPE) for _ in range(chain)]
    cache = caches[0]
    layout = PageLayout.of(cache, HKV, "interleaved")
    views = [(layout.page_keys(c), layout.page_values(c)) for c in caches]
    scores = torch.randn(rows, step.page_cap, device="cuda")
    if selection == "first":  # the first selectable pages: a row reads one run of consecutive logical pages
        scores = -torch.arange(step.page_cap, device="cuda", dtype=torch.float32).expand(rows, -1).contiguous()
    sel, counts = select_top_pages_triton(scores, cols, HKV, step.select_caps[policy], counters=step.topk_counters)
    query = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(query)
    host = step.host_columns[policy][0]
    attended = int(host[SELECT] + host[HEAD] + host[TOTAL] - host[TAIL])
    kv_bytes = rows * attended * N * D * 2 * cache.element_size()
    sms = num_sms(query.device)
    r = {"batch": batch, "context": context, "fraction": fraction, "selection": selection, "rows": rows,
         "pages_per_row": attended,
         "kv_mib": kv_bytes / 2**20, "default_splits": num_splits(rows, query.device)}  # fmt: skip
    dense = flash_dense_ms(timer, caches, step.block_table, batch, context)
    if dense is not None:
        dense_bytes = rows * (context + 1) * D * 2 * cache.element_size()
        r["flash_attn_dense"] = {"ms": dense, "gb_per_s": dense_bytes / dense / 1e6}
    ref = None
    variants = []
    settings = list(itertools.product(*GRIDS[grid]))
    if exact_splits:  # serving's tile and launch at these splits per row exactly
        settings = [(BLOCK_N, 4, 3, -x) for x in exact_splits]
    if (BLOCK_N, 4, 3, 2) not in settings:  # the serving default is always timed, first
        settings.insert(0, (BLOCK_N, 4, 3, 2))
    for block_n, warps, stages, pps in settings:
        splits = -pps if pps < 0 else max(1, min(128, -(-pps * sms // rows)))

        kv = layer_cycle(views)

        def attend(block_n=block_n, warps=warps, stages=stages, splits=splits, kv=kv):
            pk, pv = kv()
            decode_attention_triton(query, pk, pv, step.block_table, sel, counts, cols, layout.num_head_slots,
                                    SCALE, out, splits, block_n=block_n, num_warps=warps, num_stages=stages)  # fmt: skip

        try:
            ms = timer(graphed(attend, chain)) / chain  # the last captured call reads caches[0]
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a large tile
            variants.append(
                {"block_n": block_n, "warps": warps, "stages": stages, "programs_per_sm": pps, "error": str(e)[:200]}
            )
            continue
        if ref is None:
            ref = out.clone()
        err = float((out.float() - ref.float()).abs().max())
        variants.append({"block_n": block_n, "warps": warps, "stages": stages, "programs_per_sm": pps, "splits": splits,
                         "ms": ms, "gb_per_s": kv_bytes / ms / 1e6, "max_diff_vs_first": err})  # fmt: skip
    ok = [v for v in variants if "ms" in v]
    default = next(
        v for v in ok if v["block_n"] == BLOCK_N and v["warps"] == 4 and v["stages"] == 3 and v["programs_per_sm"] == 2
    )
    best = min(ok, key=lambda v: v["ms"])
    table, kv_lens = sparse_rows_table(step, cols, sel, counts, layout.num_head_slots)
    for splits in sorted({num_splits(rows, query.device), 32}):
        timed = flash_sparse_rows(timer, views, query, table, kv_lens, splits)
        if timed is not None:
            ms, fa_out = timed
            r[f"flash_attn_sparse_rows_splits{splits}"] = {
                "ms": ms, "gb_per_s": kv_bytes / ms / 1e6,
                "max_diff_vs_ours": float((fa_out.float() - ref.float()).abs().max()),
            }  # fmt: skip
    r.update(default=default, best=best, best_speedup=default["ms"] / best["ms"], variants=variants)
    from vllm_sparse.kernels.decode_attention import _decode_attn_kernel

    r["compiled"] = compiled_variants(_decode_attn_kernel)
    for c in r["compiled"]:
        c["resident_per_sm"] = resident_per_sm(c["n_regs"], c["shared"], c["num_warps"], query.device)
    print(json.dumps({k: v for k, v in r.items() if k != "variants"}), flush=True)
    return r


def main() -> None:
    global N, HQ, HKV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--grid", choices=sorted(GRIDS), default="launch", help="which settings to sweep")
    ap.add_argument(
        "--cases",
        help="BATCH:CONTEXT:FRACTION,... (fraction 1: dense rows, every page); default: "
        + ",".join(f"{b}:{c}:{f}" for b, c, f in CASES),
    )
    ap.add_argument("--page-size", type=int, default=N, help="tokens per page (Quest's GPU default is 32)")
    ap.add_argument(
        "--splits",
        help="SPLITS,...: time serving's tile and launch at exactly these splits per row instead of --grid "
        "(e.g. 16,17 for 32 rows: one wave of 4 programs on each of 132 SMs, and 16 programs past it)",
    )
    ap.add_argument("--heads", default=f"{HQ}:{HKV}", help="QUERY_HEADS:KV_HEADS (Qwen2.5-Coder-1.5B: 12:2)")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="write", help="how the L2 is emptied (gpu_timing)")
    ap.add_argument(
        "--chain",
        type=int,
        default=1,
        help="calls captured back to back in one graph, each over a cache of its own as consecutive layers read, "
        "time per call (what a layer pays inside vLLM's full graph, the graph's launch paid once), "
        "FlashAttention's calls alike",
    )
    ap.add_argument(
        "--selection",
        choices=["random", "first"],
        default="random",
        help="which pages the rows attend: the top of random scores over a random block table (scattered), or the "
        "first selectable ones over an ordered table (consecutive in memory, as a dense row's)",
    )
    args = ap.parse_args()
    N = bench_decode_select_gpu.N = args.page_size
    HQ, HKV = bench_decode_select_gpu.HQ, bench_decode_select_gpu.HKV = tuple(int(x) for x in args.heads.split(":"))
    cases = CASES
    if args.cases:
        cases = [(int(b), int(c), float(f)) for b, c, f in (x.split(":") for x in args.cases.split(","))]
    exact = [int(x) for x in args.splits.split(",")] if args.splits else None
    torch.manual_seed(0)
    t0 = time.time()
    timer = Timer(args.reps, flush=args.flush)
    res = {
        "bench": "decode_attention_tuning_gpu",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "sms": num_sms(torch.device("cuda")),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "method": f"CUDA-graph replays, CUDA events, median of reps, L2 flushed before each rep ({args.flush})",
        "flush": args.flush,
        "reps": args.reps,
        "grid": args.grid,
        "page_size": N,
        "heads": {"query": HQ, "kv": HKV, "head_dim": D},
        "selection": args.selection,
        "chain": args.chain,
        "splits": args.splits,
        "cases": [case(timer, b, ctx, f, args.grid, args.selection, args.chain, exact) for b, ctx, f in cases],
    }
    res["seconds"] = round(time.time() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
