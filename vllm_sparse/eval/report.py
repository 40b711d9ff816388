"""Write an eval run's results: per-sample JSON, a summary JSON, a markdown table and PNG plots.

Files in the run's ``out_dir``:

* ``samples.json``  one record per (backend, sample): prompt hash, expected, output, score, ...;
* ``summary.json``  config, machine, command, timings; per (backend, task, context) the mean score,
                    sample count and 95% interval, and per sparse backend the paired difference to
                    dense on the same prompts with its 95% interval (``cells.py``, ``intervals.py``);
* ``report.md``     the same as tables: per task and context each backend's mean [95% interval],
                    then each sparse backend's paired difference to dense [95% interval];
* ``accuracy_vs_context.png``  mean accuracy over tasks against context length, one line per backend,
                               with its 95% intervals;
* ``accuracy_vs_budget.png``   mean accuracy against budget fraction, one line per (method, context),
                               the dense accuracy as a dashed line of the same colour.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_sparse.eval.cells import ALL, accuracy_table, paired_table
from vllm_sparse.eval.stats_tables import accuracy_json, accuracy_lines, difference_json, difference_lines

RERENDER_HINT = "python -m vllm_sparse.eval.report OUT_DIR"
logger = logging.getLogger(__name__)


def cpu_model() -> str:
    """The CPU's model name from ``lscpu`` (``platform.processor()`` where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """CPU, core count, GPU (if any) and library versions."""
    info: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        pass
    return info


def backend_config(backend, config_file: str | Path | None = None):
    """The ``SparseConfig`` a sparse backend of a run ran: its inline settings resolved over its ``config`` file,
    read where the run read it, or from ``config_file`` in its place, as the engine resolves them.

    Raises:
        ValueError: the file is not there (a run made on another machine), the settings are refused, or the
            backend is not a sparse one.
    """
    from vllm_sparse.config import ADDITIONAL_CONFIG_KEY, method_of_backend, resolve_config

    sparse = dict(backend.sparse or {})
    if config_file is not None:
        sparse["config"] = str(config_file)
    return resolve_config(method_of_backend(backend.name), additional_config={ADDITIONAL_CONFIG_KEY: sparse}).config


def _budget_tokens(backend, contexts) -> str:
    """``4096: 1024, 8192: 1024``: the budget in tokens at each context (min/max clamps applied), from the
    backend's inline config over its ``config`` file where that file is still where the run read it (else the
    inline budget alone, marked so: the file's ``min_tokens`` or ``max_tokens`` may differ)."""
    from vllm_sparse.config import Budget

    sparse = backend.sparse or {}
    note = ""
    try:
        budget = backend_config(backend).budget
    except ValueError:  # the file is gone (a run made on another machine), or no sparse backend
        try:
            budget = Budget(**sparse.get("budget", {}))
        except ValueError:
            return "?"
        note = " (inline budget; its config file was not found here)" if "config" in sparse else ""
    return ", ".join(f"{c}: {budget.tokens(c)}" for c in contexts) + note


def markdown(result, table: dict, machine: dict, command: str, dense_reruns: list[dict] | None = None,
             pooled_from: list[dict] | None = None) -> str:  # fmt: skip
    """The report: header (model, machine, command, timings) and the dense-beside-sparse table.

    ``dense_reruns``: a joined run's other dense runs, compared output by output with its reference (``join``).
    ``pooled_from``: the runs on other prompts that a pooled report holds (``pool``), with their seeds and samples.
    """
    runs = result.runs
    dense = next((r.backend.label for r in runs if not r.backend.is_sparse), None)
    sparse = [r.backend.label for r in runs if r.backend.is_sparse]
    tasks = list(dict.fromkeys(s.task for s in result.samples)) + [ALL]
    contexts = sorted({s.context for s in result.samples})
    hay = sorted({s.haystack for s in result.samples})
    cfg = result.config
    lines = [
        f"# Accuracy: {cfg.model}",
        "",
        (
            f"- machine: {machine.get('gpu') or machine['cpu']} ({machine['cores']} cores), "
            f"vLLM {machine.get('vllm', '?')}, torch {machine.get('torch', '?')}"
        ),
        f"- command: `{command}`",
        (
            (
                "- samples and seeds: as pooled below; "
                if pooled_from
                else f"- samples per task and context: {cfg.samples}; "
            )
            + f"depths {list(cfg.depths)}; "
            + ("" if pooled_from else f"seed {cfg.seed}; ")
            + f"greedy; dtype {cfg.dtype}; block size {cfg.block_size}; "
            f"max_num_batched_tokens {cfg.max_num_batched_tokens}; haystack: {', '.join(hay)}"
        ),
        *(
            [
                f"- pooled from {len(pooled_from)} runs on other prompts: "
                + "; ".join(
                    f"seed {p['seed']}, {p['samples']} samples at {', '.join(map(str, p['contexts']))}"
                    for p in pooled_from
                )
                + " (cells count every prompt they hold)"
            ]
            if pooled_from
            else []
        ),
        *(
            [
                f"- dense re-runs of the joined groups: {sum(r['same_outputs'] for r in dense_reruns)} of "
                f"{sum(r['outputs'] for r in dense_reruns)} outputs identical to the reference dense run"
            ]
            if dense_reruns
            else []
        ),
        "",
        "| backend | engine start (s) | generate (s) | KV pages attended: all steps | prefill chunks only |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        shown = []
        for key in ("attended_share", "prefill_attended_share"):
            share = r.page_counters.get(key)
            shown.append(f"{100 * share:.1f}%" if share is not None and r.backend.is_sparse else "100% (dense)")
        lines.append(f"| {r.backend.label} | {r.start_s} | {r.generate_s} | {shown[0]} | {shown[1]} |")
    for r in runs:
        if r.backend.sparse:
            lines.append(f"\n`{r.backend.label}` sparse_attention: `{json.dumps(r.backend.sparse)}`")
            lines.append(
                f"(past tokens selected per KV head at the full context: {_budget_tokens(r.backend, contexts)})"
            )
    records = [rec for r in runs for rec in r.records]
    lines += accuracy_lines(table, dense, sparse, tasks, contexts)
    if dense:
        lines += difference_lines(paired_table(records, dense), dense, sparse, tasks, contexts)
    return "\n".join(lines) + "\n"


def plot_context(result, table: dict, path: Path) -> None:
    """Mean accuracy over tasks against context length, one line per backend, with the 95% intervals
    as error bars (backends side by side, slightly shifted, so that the bars stay apart)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({s.context for s in result.samples})
    fig, ax = plt.subplots(figsize=(6, 4))
    nan = float("nan")
    for i, r in enumerate(result.runs):
        cells = [table.get((r.backend.label, ALL, c)) for c in contexts]
        ys = [c.mean if c else nan for c in cells]
        err = [[c.mean - c.lo if c and c.lo is not None else nan for c in cells],
               [c.hi - c.mean if c and c.hi is not None else nan for c in cells]]  # fmt: skip
        xs = [c * 2 ** (0.03 * (i - (len(result.runs) - 1) / 2)) for c in contexts]
        style = "--" if not r.backend.is_sparse else "-"
        ax.errorbar(xs, ys, yerr=err, marker="o", linestyle=style, capsize=3, label=r.backend.label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy (mean over tasks)")
    ax.set_title(f"{result.config.model}: accuracy vs context")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_budget(result, table: dict, path: Path) -> None:
    """Mean accuracy against budget fraction per (method, context); dense as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({s.context for s in result.samples})
    dense = next((r.backend.label for r in result.runs if not r.backend.is_sparse), None)
    methods = sorted({r.backend.method for r in result.runs if r.backend.is_sparse})
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ctx in enumerate(contexts):
        color = colors[i % len(colors)]
        for method in methods:
            points = sorted(
                (r.backend.budget, table[(r.backend.label, ALL, ctx)].mean)
                for r in result.runs
                if r.backend.method == method and (r.backend.label, ALL, ctx) in table and r.backend.budget
            )
            if points:
                ax.plot(*zip(*points), marker="o", color=color, label=f"{method} @ {ctx // 1024}K")
        if dense and (dense, ALL, ctx) in table:
            ax.axhline(table[(dense, ALL, ctx)].mean, color=color, linestyle="--", label=f"dense @ {ctx // 1024}K")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("budget (fraction of the context)")
    ax.set_ylabel("accuracy (mean over tasks)")
    ax.set_title(f"{result.config.model}: accuracy vs budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result, machine: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, str]:
    """Write every output file of ``result`` into its ``out_dir``; returns their paths by kind.

    ``machine`` is the measuring machine (default: this one, :func:`machine_info`); ``extra`` adds
    top-level keys to ``summary.json`` (``join`` records its dense re-runs there).
    """
    from vllm_sparse.eval.runner import config_dict

    out = Path(result.config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = [rec for r in result.runs for rec in r.records]
    table = accuracy_table(records)
    dense = next((r.backend.label for r in result.runs if not r.backend.is_sparse), None)
    machine = machine or machine_info()
    command = result.config.command or " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])
    files = {
        "samples": out / "samples.json",
        "summary": out / "summary.json",
        "markdown": out / "report.md",
        "plot_context": out / "accuracy_vs_context.png",
        "plot_budget": out / "accuracy_vs_budget.png",
    }
    files["samples"].write_text(json.dumps(records, indent=1) + "\n")
    summary = {
        "model": result.config.model,
        "model_path": result.model_path,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine,
        "command": command,
        "config": config_dict(result.config),
        "backends": [
            {
                "label": r.backend.label,
                "attention_backend": r.backend.name,
                "sparse_attention": r.backend.sparse,
                "engine_start_s": r.start_s,
                "generate_s": r.generate_s,
                "page_counters": r.page_counters,
            }
            for r in result.runs
        ],
        "accuracy": accuracy_json(table),
        "paired_difference": difference_json(paired_table(records, dense)) if dense else [],
        **(extra or {}),
    }
    files["summary"].write_text(json.dumps(summary, indent=1) + "\n")
    extra = extra or {}
    result.markdown = markdown(result, table, machine, command, extra.get("dense_reruns"), extra.get("pooled_from"))
    files["markdown"].write_text(result.markdown)
    if importlib.util.find_spec("matplotlib") is None:
        logger.warning("matplotlib is not installed: no PNG plots (re-render later with `%s`)", RERENDER_HINT)
        del files["plot_context"], files["plot_budget"]
    else:
        plot_context(result, table, files["plot_context"])
        plot_budget(result, table, files["plot_budget"])
    result.files = {k: str(v) for k, v in files.items()}
    return result.files


def load_result(out_dir: str | os.PathLike[str]):
    """Rebuild an eval result from the ``summary.json`` and ``samples.json`` a run wrote.

    Used to re-render the markdown and the plots on another machine (for example after a GPU run
    whose host had no matplotlib).
    """
    from vllm_sparse.eval.runner import Backend, BackendRun, EvalConfig, EvalResult

    out = Path(out_dir)
    summary = json.loads((out / "summary.json").read_text())
    records = json.loads((out / "samples.json").read_text())
    cfg = dict(summary["config"])
    backends = [Backend(**b) for b in cfg.pop("backends") or []]
    config = EvalConfig(**cfg, backends=backends or None)
    config.out_dir = str(out)
    config.command = summary["command"]
    by_label = {b.label: b for b in backends}
    runs = []
    for entry in summary["backends"]:
        backend = by_label.get(entry["label"]) or Backend(
            entry["label"], entry["attention_backend"], entry["sparse_attention"]
        )
        mine = [r for r in records if r["backend"] == entry["label"]]
        runs.append(BackendRun(backend, mine, entry["engine_start_s"], entry["generate_s"], entry["page_counters"]))
    return EvalResult(config, summary["model_path"], samples_of(runs[0].records if runs else []), runs)


def samples_of(records: list[dict[str, Any]]) -> list:
    """What a report needs of each sample (task, context, haystack), from one backend's records."""
    from types import SimpleNamespace

    return [SimpleNamespace(task=r["task"], context=r["context"], haystack=r["haystack"]) for r in records]


def rerender(out_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Write report.md and the PNG plots of a finished run again from its JSON files.

    The machine recorded is the one the run measured on, not the one re-rendering.
    """
    result = load_result(out_dir)
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    records = [rec for r in result.runs for rec in r.records]
    table = accuracy_table(records)
    out = Path(out_dir)
    result.markdown = markdown(
        result, table, summary["machine"], summary["command"], summary.get("dense_reruns"), summary.get("pooled_from")
    )
    (out / "report.md").write_text(result.markdown)
    plot_context(result, table, out / "accuracy_vs_context.png")
    plot_budget(result, table, out / "accuracy_vs_budget.png")
    return {"markdown": str(out / "report.md"), "plot_context": str(out / "accuracy_vs_context.png"),
            "plot_budget": str(out / "accuracy_vs_budget.png")}  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {RERENDER_HINT}")
    for kind, path in rerender(sys.argv[1]).items():
        print(f"{kind}: {path}")
