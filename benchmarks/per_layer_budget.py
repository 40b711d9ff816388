"""Per-layer budgets from a recall run: spend the same pages where they buy the most attention recall.

Reads a `vllm-sparse recall` result (``recall.json``, or gzipped: one record per prompt, phase, budget, method and layer) run
at several ``--budgets`` for one method. For every layer the engine runs sparse, its mean recall (over the prompts
and ``--phases``) against the pages it attends at each budget (selected plus forced, per KV head) makes a curve;
the curve is made concave (its upper hull) and the layers share out a page budget by greedy marginal gain, in
steps of ``--step`` of the widest budget's pages, until their mean equals what the uniform ``--mean`` budget
attends. On concave curves the greedy split is the best one.

Prints the predicted mean recall of the split against the uniform budget's measured one and writes the
``layers:`` block of a sparse config (``--out``): each layer's budget fraction, interpolated between the measured
budgets from its share of pages, with ``min_tokens: 0`` so that the fraction holds at any context.

    python benchmarks/per_layer_budget.py RECALL_JSON --method quest --mean 0.25 [--phases decode prefill_last]
        [--out layers.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np


def layer_curves(records: list[dict], method: str, phases: list[str]) -> dict[int, list[tuple[float, float, float]]]:
    """``{layer: [(pages, recall, budget), ...]}`` ascending in pages: per measured budget, the layer's mean
    attended pages (selected + forced) and mean recall over the records of ``method`` in ``phases``; of budgets
    that attend the same pages only the largest is kept."""
    acc: dict[tuple[int, float], list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if r["method"] != method or r["phase"] not in phases or r["dense_layer"]:
            continue
        pages = sum(r["selected_pages"]) / len(r["selected_pages"]) + r["forced_pages"]
        acc[(r["layer"], r["budget"])].append((pages, r["recall"]))
    curves: dict[int, dict[float, tuple[float, float, float]]] = defaultdict(dict)
    for (layer, budget), xs in sorted(acc.items()):
        pages = round(sum(p for p, _ in xs) / len(xs), 6)
        # budgets that attend the same pages (a small fraction raised to the budget's min_tokens): the largest,
        # which attends them with no minimum
        curves[layer][pages] = (pages, sum(v for _, v in xs) / len(xs), budget)
    return {layer: sorted(c.values()) for layer, c in sorted(curves.items())}


def upper_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The concave upper hull of ``(x, y)`` points sorted by ``x`` (equal ``x``: the best ``y``)."""
    best: dict[float, float] = {}
    for x, y in points:
        best[x] = max(y, best.get(x, float("-inf")))
    hull: list[tuple[float, float]] = []
    for p in sorted(best.items()):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):  # hull[-1] lies on or below the chord
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear ``y(x)`` through ``(xs, ys)`` (``xs`` ascending), clamped at the ends."""
    return float(np.interp(x, xs, ys))


def split_pages(hulls: dict[int, list[tuple[float, float]]], total: float, step: float) -> dict[int, float]:
    """Pages per layer summing to ``total`` (each between its hull's first and last ``x``): every layer starts
    at its first point, then ``step`` pages at a time go to the layer whose hull rises most over them."""
    pages = {layer: h[0][0] for layer, h in hulls.items()}
    left = total - sum(pages.values())
    if left < -1e-9:
        raise ValueError(f"{total:.1f} pages are fewer than the smallest budget's {sum(pages.values()):.1f}")

    def gain(layer: int, amount: float) -> float:
        h = hulls[layer]
        xs, ys = [x for x, _ in h], [y for _, y in h]
        x = pages[layer]
        return interp(min(x + amount, xs[-1]), xs, ys) - interp(x, xs, ys)

    while left > 1e-9:
        amount = min(step, left)
        open_layers = [layer for layer, h in hulls.items() if pages[layer] < h[-1][0] - 1e-9]
        if not open_layers:
            raise ValueError(f"{total:.1f} pages exceed every layer's widest budget")
        layer = max(open_layers, key=lambda lyr: (gain(lyr, amount), -lyr))
        add = min(amount, hulls[layer][-1][0] - pages[layer])
        pages[layer] += add
        left -= add
    return pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recall_json")
    ap.add_argument("--method", default="quest")
    ap.add_argument("--mean", type=float, required=True, help="the uniform budget (one of the run's budgets)")
    ap.add_argument("--phases", nargs="+", default=["decode", "prefill_last", "prefill"])
    ap.add_argument("--step", type=float, default=1 / 64, help="share of the widest budget's pages per greedy step")
    ap.add_argument("--out", help="write {'layers': {...}} here (JSON, for a sparse config or a --variant)")
    args = ap.parse_args()
    path = Path(args.recall_json)
    result = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
    curves = layer_curves(result["records"], args.method, args.phases)
    if not curves:
        raise SystemExit(f"no sparse-layer records of {args.method!r} in phases {args.phases}")
    budgets = sorted({b for c in curves.values() for _, _, b in c})
    if args.mean not in budgets:
        raise SystemExit(f"--mean {args.mean} is not one of the run's budgets {budgets}")
    uniform = {layer: next((p, r) for p, r, b in c if b == args.mean) for layer, c in curves.items()}
    hulls = {layer: upper_hull([(p, r) for p, r, _ in c]) for layer, c in curves.items()}
    widest = max(h[-1][0] for h in hulls.values())
    pages = split_pages(hulls, sum(p for p, _ in uniform.values()), args.step * widest)
    layers, rows = {}, []
    for layer, c in curves.items():
        xs, fractions = [p for p, _, _ in c], [b for _, _, b in c]
        fraction = round(interp(pages[layer], xs, fractions), 4)
        predicted = interp(pages[layer], [x for x, _ in hulls[layer]], [y for _, y in hulls[layer]])
        layers[str(layer)] = {"budget": {"fraction": fraction, "min_tokens": 0}}
        rows.append((layer, uniform[layer][1], predicted, fraction))
    n = len(rows)
    print(f"{args.method}, phases {args.phases}, {n} sparse layers, uniform budget {args.mean}")
    print("layer  uniform recall  split recall (predicted)  fraction")
    for layer, u, p, f in rows:
        print(f"{layer:5d}  {u:14.4f}  {p:24.4f}  {f:8.4f}")
    print(f"mean   {sum(r[1] for r in rows) / n:14.4f}  {sum(r[2] for r in rows) / n:24.4f}  "
          f"{sum(r[3] for r in rows) / n:8.4f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"layers": layers}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
