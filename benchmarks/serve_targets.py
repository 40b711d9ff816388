"""The serving targets of issues 11 and 18, checked against the mean of several `serve_bench` runs.

Each run is a ``serve_bench.json`` whose ratios are to the FLASH_ATTN measured on the same machine
in the same run; a backend's value is the mean of its runs' ratios. Writes ``targets.json`` (every
target, the runs' values, their mean, met or not) and prints one line per target.

    python benchmarks/serve_targets.py --out benchmarks/results/serve_bench_h100_session10/targets.json

Which runs stand for a backend can differ per load (``use``): a load re-measured after a change of the
code it exercises takes the new runs only. ``--run serve_bench.json`` checks one run alone (a run on
another GPU kind, whose ratios must not be averaged with these).
"""

import argparse
import json
import shlex
import sys

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--out", required=True)
ap.add_argument("--run", help="check this serve_bench.json alone (every backend it holds) instead of the recorded runs")
ARGS = ap.parse_args()
OUT = ARGS.out

R = "benchmarks/results/"
runs = {
    "s8_run1": R + "serve_bench_h100_session8/run1/serve_bench.json",
    "s8_run2": R + "serve_bench_h100_session8/run2/serve_bench.json",
    "s7_run2": R + "serve_bench_h100_session7/run2_twilight/serve_bench.json",
    "s9": R + "serve_bench_h100_session9/sb/serve_bench.json",
    "s10": R + "serve_bench_h100_session10/sb/serve_bench.json",
}
# backend -> {load or "*": runs}; session 9 re-measured the decode loads after the split top-k; session
# 10 every load of Quest, Twilight and QuoKA after the 64-query prefill window became their default and
# a decode step's writes became one launch (both change every load)
DECODE_LOADS = ("tpot128k", "decode16", "C")
use = {
    "sparse_quest": {"*": ["s10"]},
    "sparse_twilight": {"*": ["s10"]},
    "sparse_quoka": {"*": ["s10"]},
    "sparse_quoka+sparse_decode": {"*": ["s8_run1"]} | {ld: ["s9"] for ld in DECODE_LOADS},
    "FLASHINFER": {"*": ["s8_run1"]},
}
WHAT = "H100 80GB HBM3"
if ARGS.run:  # one run: its own backends against its own FLASH_ATTN
    runs = {"run": ARGS.run}
    use = {b: {"*": ["run"]} for b in use}
    WHAT = json.load(open(ARGS.run)).get("gpu", "?").split("\n")[0]
docs = {k: json.load(open(v))["summary"] for k, v in runs.items()}
targets = [
    (
        "decode16",
        "decode_throughput_vs_flash_attn",
        {
            "sparse_quest": (">=", 2.0),
            "sparse_twilight": (">=", 1.5),
            "sparse_quoka": (">=", 0.95),
            "sparse_quoka+sparse_decode": (">=", 1.5),
        },
    ),
    (
        "tpot128k",
        "tpot_vs_flash_attn",
        {"sparse_quest": ("<=", 0.6), "sparse_twilight": ("<=", 0.75), "sparse_quoka": ("<=", 1.05)},
    ),
    (
        "tpot128k",
        "ttft_vs_limit",
        {
            "sparse_quest": ("<=", 1.1),
            "sparse_twilight": ("<=", 1.1),
            "sparse_quoka": ("<=", 1.1),
            "sparse_quoka+sparse_decode": ("<=", 1.1),
        },
    ),
    (
        "A",
        "throughput_vs_flash_attn",
        {"sparse_quest": (">=", 1.05), "sparse_quoka": (">=", 1.05), "sparse_twilight": (">=", 1.0)},
    ),
    (
        "A",
        "ttft_vs_flash_attn",
        {"sparse_quest": ("<=", 0.95), "sparse_quoka": ("<=", 0.95), "sparse_twilight": ("<=", 1.0)},
    ),
    (
        "B",
        "throughput_vs_flash_attn",
        {"sparse_quest": (">=", 1.5), "sparse_quoka": (">=", 1.5), "sparse_twilight": (">=", 1.3)},
    ),
    ("B", "ttft_vs_flash_attn", {"sparse_quest": ("<=", 0.7), "sparse_quoka": ("<=", 0.7)}),
    ("C", "ttft_vs_flash_attn", {b: ("<=", 1.0) for b in ["sparse_quest", "sparse_twilight", "sparse_quoka"]}),
    ("C", "tpot_vs_flash_attn", {b: ("<=", 1.1) for b in ["sparse_quest", "sparse_twilight", "sparse_quoka"]}),
    ("C", "p99_over_median_ttft", {b: ("<=", 1.2) for b in ["sparse_quest", "sparse_twilight", "sparse_quoka"]}),
]
rows = []
for load, metric, tg in targets:
    for b, (op, t) in tg.items():
        vals = []
        for r in use[b].get(load, use[b]["*"]):
            m = docs[r].get(load, {}).get(b)
            if m is None:
                continue
            if metric == "ttft_vs_limit":
                v = m.get("ttft_limit", {}).get("ttft_vs_limit")
            elif metric == "p99_over_median_ttft":
                v = m["p99_ttft_ms"] / m["median_ttft_ms"]
            else:
                v = m.get(metric)
            if v is not None:
                vals.append(round(v, 3))
        mean = round(sum(vals) / len(vals), 3) if vals else None
        ok = None if mean is None else (mean >= t if op == ">=" else mean <= t)
        rows.append(
            {"load": load, "metric": metric, "backend": b, "target": f"{op} {t}", "runs": vals, "mean": mean, "met": ok}
        )
out = {
    "what": "Targets of issues 11 and 18 against the mean of the runs named (each run a ratio to FLASH_ATTN measured on the same machine, same session); "
    + WHAT
    + ", vLLM 0.33 default mode, Llama-3.1-8B shapes with random weights, 12.5% budget, shipped defaults",
    "runs": runs,
    "runs_used": use,
    "command": "python " + shlex.join(sys.argv),
    "run_commands": "each serve_bench.json: commands",
    "rows": rows,
}
json.dump(out, open(OUT, "w"), indent=1)
for r in rows:
    print(
        f"{r['load']:9s} {r['metric']:32s} {r['backend']:28s} {r['target']:7s} {r['runs']} mean {r['mean']} {'MET' if r['met'] else 'not run' if r['met'] is None else 'missed'}"
    )
