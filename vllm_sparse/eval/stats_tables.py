"""The eval statistics (``cells.py``) as report tables: markdown for ``report.md``, rows for
``summary.json``.

* accuracy: per (backend, task, context) the mean score with its 95% Wilson interval;
* paired difference: per (sparse backend, task, context) the mean of (sparse - dense) on the same
  prompts with its 95% paired-t interval, bold where the interval excludes zero.
"""

from __future__ import annotations

from typing import Any

from vllm_sparse.eval.cells import ALL


def _ci(cell, signed: bool = False) -> str:
    """``0.85 [0.64, 0.95]`` (``signed``: ``+0.05 [-0.10, +0.20]``); no bounds: the mean alone."""
    f = "{:+.2f}" if signed else "{:.2f}"
    if cell.lo is None:
        return f.format(cell.mean)
    return f"{f.format(cell.mean)} [{f.format(cell.lo)}, {f.format(cell.hi)}]"


def accuracy_lines(
    table: dict, dense: str | None, sparse: list[str], tasks: list[str], contexts: list[int]
) -> list[str]:
    """The accuracy table: per task and context, each backend's mean score with its 95% interval."""
    n = sorted({c.n for (b, t, _), c in table.items() if t != ALL})
    lines = [
        "",
        f"Accuracy: mean score [95% interval] over n = {', '.join(map(str, n))} samples per task and context "
        "(Wilson score interval; exact for 0/1 scores, conservative for graded ones; "
        f"**{ALL}** pools every sample of the context)"
        + (": fewer than 20 samples per cell give wide intervals, and the paired-t ones below are unreliable"
           if n and n[0] < 20 else "") + ":",
        "",
    ]  # fmt: skip
    header = ["task", "context", f"{dense} (dense)" if dense else "dense", *sparse]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for ctx in contexts:
        for task in tasks:
            row = [task if task != ALL else f"**{ALL}**", str(ctx)]
            for label in [dense, *sparse]:
                cell = table.get((label, task, ctx))
                row.append("-" if cell is None else _ci(cell))
            lines.append("| " + " | ".join(row) + " |")
    return lines


def difference_lines(paired: dict, dense: str, sparse: list[str], tasks: list[str], contexts: list[int]) -> list[str]:
    """The paired table: per task and context, each sparse backend's score minus dense on the same
    prompts, with its 95% interval; bold where the interval excludes zero."""
    lines = [
        "",
        f"Difference to {dense} on the same prompts: mean of (sparse - dense) per sample [95% paired-t "
        "interval]; **bold**: the interval excludes 0 (a difference these samples show):",
        "",
    ]
    lines += ["| " + " | ".join(["task", "context", *sparse]) + " |", "|" + "---|" * (2 + len(sparse))]
    unpaired = 0
    for ctx in contexts:
        for task in tasks:
            row = [task if task != ALL else f"**{ALL}**", str(ctx)]
            for label in sparse:
                entry = paired.get((label, task, ctx))
                if entry is None:
                    row.append("-")
                    continue
                diff, missing = entry
                unpaired += missing if task != ALL else 0
                text = _ci(diff, signed=True)
                row.append(f"**{text}**" if diff.excludes_zero else text)
            lines.append("| " + " | ".join(row) + " |")
    if unpaired:
        lines.append(f"\n({unpaired} sparse samples had no dense run of the same prompt and are left out.)")
    return lines


def _cell_order(item) -> tuple:
    (backend, task, ctx), _ = item
    return ctx, task, backend


def accuracy_json(table: dict) -> list[dict[str, Any]]:
    """``summary.json``'s ``accuracy``: per (backend, task, context) the mean (``accuracy``), ``n``,
    ``ci95`` and ``ci_method``."""
    out = []
    for (b, t, c), cell in sorted(table.items(), key=_cell_order):
        d = cell.as_dict()
        out.append({"backend": b, "task": t, "context": c, "accuracy": d.pop("mean"), **d})
    return out


def difference_json(paired: dict) -> list[dict[str, Any]]:
    """``summary.json``'s ``paired_difference``: per (sparse backend, task, context) the mean of
    (sparse - dense) over ``n`` paired samples with ``ci95``; ``unpaired``: samples left out."""
    out = []
    for (b, t, c), (diff, missing) in sorted(paired.items(), key=_cell_order):
        d = diff.as_dict()
        out.append({"backend": b, "task": t, "context": c, "difference": d.pop("mean"), **d, "unpaired": missing})
    return out
