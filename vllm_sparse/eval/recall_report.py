"""Summaries, tables and plots of an attention-recall run (``eval/recall_run.py``).

Files written into the run's folder:

* ``recall.json``   command, config, machine, prompts, the summary and every record;
* ``tables.md``     per context, phase, budget and method: mean recall over the layers the engine
                    runs sparse and over the prompts, the oracle's, the gap, the needle pages
                    attended, and the worst layers and KV heads;
* ``recall_per_layer_<N>k.png``  per context: recall per layer (one panel per phase and budget), a
                    solid line per method, its oracle dashed in the same colour.

Re-render from ``recall.json`` (e.g. after changing this file): ``python -m vllm_sparse.eval.recall_report DIR``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm_sparse.eval.recall_run import PHASES

METRICS = ("recall", "oracle", "selectable", "oracle_selectable")


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def per_layer(records: list[dict[str, Any]]) -> dict[tuple, dict[str, float]]:
    """``{(context, phase, budget, method, layer): {metric: mean over prompts}}``."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["context"], r["phase"], r["budget"], r["method"], r["layer"])].append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {m: _mean(r[m] for r in rs) for m in METRICS}
        out[key]["needle"] = _mean(x for r in rs for x in r["needle"] or [])
        out[key]["dense_layer"] = rs[0]["dense_layer"]
    return out


def _worst_heads(rs: list[dict], count: int = 3) -> list[dict[str, Any]]:
    """The ``count`` (layer, KV head) pairs of lowest mean recall over prompts, with the oracle's."""
    acc: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for r in rs:
        for h, (row, orow) in enumerate(zip(r["recall_heads"], r["oracle_heads"], strict=True)):
            acc[(r["layer"], h)].append((_mean(row), _mean(orow)))
    means = {k: (_mean(a for a, _ in v), _mean(b for _, b in v)) for k, v in acc.items()}
    worst = sorted(means.items(), key=lambda kv: kv[1][0])[:count]
    return [{"layer": lyr, "kv_head": h, "recall": round(a, 4), "oracle": round(b, 4)} for (lyr, h), (a, b) in worst]


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


def _needle_summary(rs: list[dict]) -> dict[str, Any]:
    """``needle``/``oracle_needle``: mean share of the needle's past pages attended (records with
    such pages); ``needle_kept``/``oracle_needle_kept``: the dense mass on the needle's past pages
    that is attended over all of it (mass-weighted: layers and heads that look at the needle
    count most); ``needle_lost_layers``: the 3 layers losing the most needle mass, with the share
    of their needle mass lost."""
    with_needle = [r for r in rs if r["needle"] is not None]
    total = sum(sum(r["needle_mass"]) for r in rs)
    lost: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rs:
        lost[r["layer"]][0] += sum(r["needle_mass"]) - sum(r["needle_covered"])
        lost[r["layer"]][1] += sum(r["needle_mass"])
    worst = sorted(lost.items(), key=lambda kv: -kv[1][0])[:3]
    return {
        "needle": round(_mean(x for r in with_needle for x in r["needle"]), 4) if with_needle else None,
        "oracle_needle": round(_mean(x for r in with_needle for x in r["oracle_needle"]), 4) if with_needle else None,
        "needle_kept": _ratio(sum(sum(r["needle_covered"]) for r in rs), total),
        "oracle_needle_kept": _ratio(sum(sum(r["oracle_needle_covered"]) for r in rs), total),
        "needle_lost_layers": [{"layer": lyr, "lost": _ratio(a, b)} for lyr, (a, b) in worst if a > 0],
    }


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (context, phase, budget, method), over the layers that are not dense layers and over
    the prompts: mean recall, oracle, selectable shares, needle pages attended, pages selected per
    KV head, the 3 worst layers and the 3 worst (layer, KV head) pairs; ``engine_dense``: the
    engine runs this step dense (QuoKA's decode), so these numbers say what a sparse one would do."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if not r["dense_layer"]:
            groups[(r["context"], r["phase"], r["budget"], r["method"])].append(r)
    layers = per_layer(records)
    out = []
    for (ctx, phase, budget, method), rs in sorted(groups.items()):
        lay = sorted(
            ((k[4], v) for k, v in layers.items() if k[:4] == (ctx, phase, budget, method) and not v["dense_layer"]),
            key=lambda kv: kv[1]["recall"],
        )
        out.append({
            "context": ctx, "phase": phase, "budget": budget, "method": method,
            "engine_dense": all(r["engine_dense"] for r in rs), "prompts": len({r["prompt"] for r in rs}),
            **{m: round(_mean(r[m] for r in rs), 4) for m in METRICS},
            **_needle_summary(rs),
            "selected_pages": round(_mean(x for r in rs for x in r["selected_pages"]), 1),
            "past_pages": round(_mean(r["past_pages"] for r in rs), 1),
            "forced_pages": round(_mean(r["forced_pages"] for r in rs), 1),
            "worst_layers": [{"layer": lyr, "recall": round(v["recall"], 4), "oracle": round(v["oracle"], 4)}
                             for lyr, v in lay[:3]],
            "worst_heads": _worst_heads(rs),
        })  # fmt: skip
    return out


def _pair(a: float | None, b: float | None) -> str:
    """``0.71 (0.81)``, or ``-`` where there is no value."""
    return "-" if a is None else f"{a:.2f} ({b:.2f})"


def tables(result: dict[str, Any]) -> str:
    """``tables.md``: the summary as markdown, one table per context."""
    lines = [
        f"# Attention recall: {result['model']}",
        "",
        f"- command: `{result['command']}`",
        f"- prompts: {len(result['prompts'])} ("
        + ", ".join(f"{p['task']}@{p['context']} depth {p['depth']}" for p in result["prompts"])
        + ")",
        f"- selector settings: {result['sparse_config']['file']} ({json.dumps(result['sparse_config']['fields'])}) "
        "with each budget's fraction",
        f"- variants: {json.dumps(result['config']['variants'])}" if result["config"]["variants"] else "",
        "",
        "Mean over the layers the engine runs sparse (dense layers left out) and over the prompts. recall: dense "
        "attention mass on the attended tokens (forced pages + selected pages + the step's own tokens); oracle: "
        "the best pages at the same count per KV head; selectable: the share of the mass on non-forced past pages "
        "that the selected pages cover; needle: share of the needle's past pages attended (per layer and KV head, "
        "prompts whose needle lies in the past); needle kept: the share of the dense mass on the needle's past "
        "pages that is attended (mass-weighted, so the layers and heads that read the needle count most), and "
        "the layers losing the most of it; pages: selected / past pages per KV head (forced pages besides). "
        "*: the engine runs this step dense.",
    ]
    by_ctx: dict[int, list[dict]] = defaultdict(list)
    for s in result["summary"]:
        by_ctx[s["context"]].append(s)
    for ctx, rows in sorted(by_ctx.items()):
        lines += ["", f"## {ctx} tokens", "",
                  "| phase | budget | method | recall | oracle | gap | selectable | oracle sel. | needle (oracle) "
                  "| needle kept (oracle) | needle lost in | pages | worst layers (recall / oracle) "
                  "| worst (layer, KV head) |",
                  "|" + "---|" * 14]  # fmt: skip
        for s in rows:
            worst = ", ".join(f"L{w['layer']} {w['recall']:.2f}/{w['oracle']:.2f}" for w in s["worst_layers"])
            heads = ", ".join(f"L{w['layer']}h{w['kv_head']} {w['recall']:.2f}" for w in s["worst_heads"])
            star = "*" if s["engine_dense"] else ""
            lost = ", ".join(f"L{w['layer']} {w['lost']:.0%}" for w in s["needle_lost_layers"]) or "-"
            lines.append(
                f"| {s['phase']} | {s['budget']:g} | {s['method']}{star} | {s['recall']:.3f} | {s['oracle']:.3f} | "
                f"{s['oracle'] - s['recall']:.3f} | {s['selectable']:.3f} | {s['oracle_selectable']:.3f} | "
                f"{_pair(s['needle'], s['oracle_needle'])} | {_pair(s['needle_kept'], s['oracle_needle_kept'])} | "
                f"{lost} | {s['selected_pages']:g} / {s['past_pages']:g} | "
                f"{worst} | {heads} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], ctx: int, path: Path) -> None:
    """Recall per layer at context ``ctx``: a panel per (phase, budget), a line per method, the
    oracle at its page counts dashed (one line for the methods that select the same counts);
    dense layers shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = per_layer([r for r in result["records"] if r["context"] == ctx])
    phases = [p for p in PHASES if any(k[1] == p for k in layers)]
    budgets = sorted({k[2] for k in layers})
    methods = list(dict.fromkeys(k[3] for k in layers))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(len(phases), len(budgets), figsize=(5.5 * len(budgets), 3.1 * len(phases) + 0.8),
                             squeeze=False, sharex=True, sharey=True)  # fmt: skip
    for i, phase in enumerate(phases):
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            oracles: dict[tuple, list[str]] = {}
            for m, method in enumerate(methods):
                pts = sorted((k[4], v) for k, v in layers.items() if k[1:4] == (phase, budget, method))
                xs = [x for x, _ in pts]
                ax.plot(xs, [v["recall"] for _, v in pts], marker=".", color=colors[m % len(colors)], label=method)
                oracles.setdefault(tuple((x, round(v["oracle"], 6)) for x, v in pts), []).append(method)
            for n, (curve, names) in enumerate(oracles.items()):
                ax.plot([x for x, _ in curve], [y for _, y in curve], linestyle="--", linewidth=1.2,
                        color="black" if n == 0 else colors[methods.index(names[0]) % len(colors)],
                        label=f"oracle at {'/'.join(names)}'s page counts")  # fmt: skip
            for lyr in sorted({k[4] for k, v in layers.items() if v["dense_layer"]}):
                ax.axvspan(lyr - 0.5, lyr + 0.5, color="grey", alpha=0.15)
            ax.set_title(f"{phase}, budget {budget:g}", fontsize=10)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("dense mass covered")
            if i == len(phases) - 1:
                ax.set_xlabel("layer (grey: dense layer)")
    handles, labels = axes[-1][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    n = len({r["prompt"] for r in result["records"] if r["context"] == ctx})
    fig.suptitle(f"{result['model']}:\nattention recall per layer at {ctx} tokens ({n} prompts)", fontsize=11)
    legend_rows = -(-len(labels) // 3)
    fig.tight_layout(rect=(0, 0.025 * legend_rows, 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend and title whole, however wide
    plt.close(fig)


def dump_json(result: dict[str, Any]) -> str:
    """The result as JSON, indented, with one line per record (``records`` is long)."""
    head = json.dumps({k: v for k, v in result.items() if k != "records"}, indent=1)
    body = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in result["records"])
    return head[:-2] + ',\n "records": [\n' + body + "\n ]\n}\n"


def write_outputs(result: dict[str, Any], out: Path) -> dict[str, str]:
    """Write ``recall.json``, ``tables.md`` and a plot per context into ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "recall.json", "tables": out / "tables.md"}
    files["json"].write_text(dump_json(result))
    files["tables"].write_text(tables(result))
    for ctx in sorted({r["context"] for r in result["records"]}):
        files[f"plot_{ctx}"] = out / f"recall_per_layer_{ctx // 1024}k.png"
        plot(result, ctx, files[f"plot_{ctx}"])
    return {k: str(v) for k, v in files.items()}


def rerender(out_dir: str | Path) -> dict[str, str]:
    """Summary, ``tables.md`` and plots of a finished run again from its ``recall.json`` (records)."""
    out = Path(out_dir)
    result = json.loads((out / "recall.json").read_text())
    result["summary"] = summarize(result["records"])
    return write_outputs(result, out)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m vllm_sparse.eval.recall_report OUT_DIR")
    for kind, path in rerender(sys.argv[1]).items():
        print(f"{kind}: {path}")
