"""Where a served decode step's time goes, from a torch-profiler trace of `vllm serve`.

``serve_bench.py run --loads prof16k`` (or ``prof128k``) starts each server with vLLM's torch profiler
(``--profiler-config``, traces under ``OUT/profile_<label>/``) and records some decode steps of one request.
This reads such a trace (Chrome trace JSON, ``.json`` or ``.json.gz``) and splits it into steps at the
host's CUDA-graph launches (a decode step in vLLM's full CUDA graphs is one ``cudaGraphLaunch``)::

    period  = time from one step's graph launch to the next one's (what TPOT is made of)
    busy    = GPU kernel, memcpy and memset time that starts within the period
    idle    = period - busy (the GPU waiting on the host, or launch gaps)
    gaps    = idle split at ``HOST_GAP_US``: the gaps at least that long (the GPU waiting for the host
              between graph replays) and the shorter ones (launch gaps between the nodes of a graph),
              with the kernels that each kind of gap precedes; and the host's ``cpu_op`` events per step

and per kernel name the time per step, and the same summed over kernel categories (``CATEGORIES``:
attention, merge of splits, selection, K/V write, GEMM, other). Two servers' reports side by side say
whether a slower step spends more GPU time (and in which kernels) or leaves the GPU idle (host work on
the critical path)::

    python benchmarks/decode_trace.py OUT/profile_flash_attn OUT/profile_sparse_quoka [--json report.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GRAPH_LAUNCH = "cudaGraphLaunch"
HOST_GAP_US = 8.0  # a GPU gap this long is the host's, not a launch gap inside a graph
#: Where a kernel's time goes in a decode step: the first category with a pattern in its name
#: (FlashAttention's combine is a merge, not attention; the top-k's write pass is selection).
CATEGORIES = (
    ("merge", ("FlashAttnFwdCombine", "_decode_merge_kernel", "_merge_kernel", "MergeState")),
    ("attention", ("FlashAttnFwd", "_decode_attn_kernel", "_attn_kernel", "BatchDecode", "BatchPrefill")),
    (
        "selection",
        (
            "_split_fused_kernel",
            "_split_pass_kernel",
            "_split_write_kernel",
            "_select_pages_kernel",
            "_quest_decode_bounds_kernel",
            "_quest_bounds_kernel",
            "_quoka_decode_score_kernel",
            "_score_pages_kernel",
            "_query_sim_kernel",
            "_top_p_kernel",
            "_decode_page_lse_kernel",
            "_page_mass_kernel",
            "_lse_partial_kernel",
            "_anchor_decode",
            "_fill_tables_kernel",
            "_last_offset_kernel",
        ),
    ),
    ("kv_write", ("reshape_and_cache", "_write_kernel", "_page_minmax_kernel")),
    ("gemm", ("nvjet", "gemm", "splitKreduce", "cublas")),
)


def category(name: str) -> str:
    """The ``CATEGORIES`` entry a kernel name falls in (``other`` where none matches)."""
    return next((cat for cat, patterns in CATEGORIES if any(p in name for p in patterns)), "other")


def load_events(path: Path) -> list[dict]:
    """The ``traceEvents`` of a Chrome trace file (plain or gzipped JSON)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def trace_files(target: Path) -> list[Path]:
    """``target`` itself, or the trace files below a folder (vLLM writes one per worker and one for the
    front end; the worker's hold the GPU events)."""
    if target.is_file():
        return [target]
    return sorted(p for p in target.rglob("*") if p.name.endswith((".json", ".json.gz")) and p.is_file())


def step_report(events: list[dict], top: int = 15) -> dict | None:
    """Steps between consecutive graph launches (None when the trace has fewer than two).

    Returns ``{"steps", "period_us", "busy_us", "idle_us"}`` (medians over the steps),
    ``"kernels"``: ``[(name, us per step)]``, the ``top`` names by total time in those steps, and
    ``"categories"``: ``{category: us per step}`` over every name (``category``).
    """
    launches = sorted(e["ts"] for e in events if e.get("name") == GRAPH_LAUNCH and "ts" in e)
    if len(launches) < 2:
        return None
    gpu = sorted(
        (e for e in events if e.get("cat") in GPU_CATEGORIES and "ts" in e and "dur" in e), key=lambda e: e["ts"]
    )
    cpu_ops = sorted(
        (e for e in events if e.get("cat") == "cpu_op" and "ts" in e and "dur" in e), key=lambda e: e["ts"]
    )
    periods, busy, per_name, host_gaps, graph_gaps, before, short_before, ops = [], [], {}, [], [], {}, {}, {}
    j = c = 0
    ready = None  # when the GPU ran out of earlier work (carried over steps: a step's first gap is the host's)
    for start, end in zip(launches, launches[1:]):
        while j < len(gpu) and gpu[j]["ts"] < start:
            j += 1
        total = long_gaps = short_gaps = 0.0
        k = j
        while k < len(gpu) and gpu[k]["ts"] < end:
            e = gpu[k]
            total += e["dur"]
            per_name[e["name"]] = per_name.get(e["name"], 0.0) + e["dur"]
            if ready is not None and e["ts"] > ready:
                gap = e["ts"] - ready
                if gap >= HOST_GAP_US:
                    long_gaps += gap
                    before[e["name"]] = before.get(e["name"], 0.0) + gap
                else:
                    short_gaps += gap
                    short_before[e["name"]] = short_before.get(e["name"], 0.0) + gap
            ready = max(ready or 0.0, e["ts"] + e["dur"])
            k += 1
        while c < len(cpu_ops) and cpu_ops[c]["ts"] < start:
            c += 1
        while c < len(cpu_ops) and cpu_ops[c]["ts"] < end:
            n, d = ops.get(cpu_ops[c]["name"], (0, 0.0))
            ops[cpu_ops[c]["name"]] = (n + 1, d + cpu_ops[c]["dur"])
            c += 1
        periods.append(end - start)
        busy.append(total)
        host_gaps.append(long_gaps)
        graph_gaps.append(short_gaps)
    steps = len(periods)
    period, work = statistics.median(periods), statistics.median(busy)
    kernels = sorted(((n, t / steps) for n, t in per_name.items()), key=lambda x: -x[1])[:top]
    categories = {cat: 0.0 for cat, _ in CATEGORIES} | {"other": 0.0}
    for n, t in per_name.items():
        categories[category(n)] += t / steps
    return {
        "steps": steps,
        "period_us": round(period, 1),
        "busy_us": round(work, 1),
        "idle_us": round(period - work, 1),
        "kernels": [(n, round(t, 2)) for n, t in kernels],
        "categories": {cat: round(t, 1) for cat, t in categories.items()},
        "host_gaps_us": round(statistics.median(host_gaps), 1),
        "graph_gaps_us": round(statistics.median(graph_gaps), 1),
        "host_gaps_before": [(n, round(t / steps, 2)) for n, t in sorted(before.items(), key=lambda x: -x[1])[:8]],
        "graph_gaps_before": [
            (n, round(t / steps, 2)) for n, t in sorted(short_before.items(), key=lambda x: -x[1])[:top]
        ],
        "cpu_ops": [
            (n, round(k / steps, 1), round(d / steps, 1))
            for n, (k, d) in sorted(ops.items(), key=lambda x: -x[1][1])[:top]
        ],
    }


def report(target: Path, top: int = 15) -> dict:
    """The step report of the trace file under ``target`` with the most graph launches."""
    best, best_path = None, None
    for path in trace_files(target):
        r = step_report(load_events(path), top)
        if r is not None and (best is None or r["steps"] > best["steps"]):
            best, best_path = r, path
    if best is None:
        raise SystemExit(f"{target}: no trace with two or more {GRAPH_LAUNCH} events")
    return {"trace": str(best_path), **best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="+", help="trace files, or folders holding them (one per server)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", help="write every report here")
    args = ap.parse_args()
    reports = {t: report(Path(t), args.top) for t in args.targets}
    for t, r in reports.items():
        print(
            f"{t}: {r['steps']} steps, period {r['period_us']} us, GPU busy {r['busy_us']} us, idle {r['idle_us']} us"
        )
        print("    per step: " + ", ".join(f"{cat} {us} us" for cat, us in r["categories"].items()))
        print(
            f"    idle: gaps of {HOST_GAP_US} us or more {r['host_gaps_us']} us, shorter {r['graph_gaps_us']} us; "
            "the long ones before: " + ", ".join(f"{n[:40]} {us}" for n, us in r["host_gaps_before"])
        )
        for name, us in r["graph_gaps_before"]:
            print(f"    gap {us:9.2f} us/step before {name[:100]}")
        for name, n, us in r["cpu_ops"]:
            print(f"    host {us:9.1f} us/step in {n:6.1f} {name[:90]}")
        for name, us in r["kernels"]:
            print(f"    {us:9.2f} us/step  {name[:110]}")
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
