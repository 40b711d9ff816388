"""Pool eval runs made on different prompts (other seeds, other samples) into one report with more samples a cell.

``join`` adds backends over the same prompts; ``pool`` adds prompts for the same backends. Each folder is a
finished run with its own dense reference (a ``vllm-sparse eval`` folder or a ``join`` of one); the pooled
report's cells hold the prompts of every folder, and each sparse backend is paired with dense prompt by prompt
as in one run (``cells.paired_table``), so its interval narrows with the pooled count. A backend that only some
folders ran is pooled over those folders, and its cells say how many prompts it has::

    python -m vllm_sparse.eval.pool OUT_DIR RUN_DIR RUN_DIR [RUN_DIR ...]

Refused: folders whose dense labels, model, tasks, dtype, page size or chunk size differ; a prompt (task,
context, sample index, prompt hash) that two folders both ran; a backend label whose settings differ between
folders (resolved over the shipped config file of the same name, since each run records where its copy of
the file lay; see ``_settings``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from vllm_sparse.eval.cells import sample_id
from vllm_sparse.eval.report import backend_config, load_result, samples_of, write_report

SAME_CONFIG = ("model", "tasks", "dtype", "block_size", "max_num_batched_tokens")


class PoolError(ValueError):
    """The runs cannot be pooled (other settings, overlapping prompts, no dense run)."""


def _settings(backend) -> Any:
    """What a sparse backend ran, for comparing runs: its inline settings resolved over its ``config`` file
    where a file of that name ships here (``config.SHIPPED_DIR``), so that an inline field equal to the file's
    compares equal to the file alone (older evals wrote ``min_tokens: 1024`` inline); else the inline
    settings with the file reduced to its name (each run records where its copy of the file lay)."""
    from vllm_sparse.config import SHIPPED_DIR

    sparse = backend.sparse
    if not sparse or "config" not in sparse:
        return sparse
    name = Path(str(sparse["config"])).name
    if (SHIPPED_DIR / name).is_file():
        try:
            return backend_config(backend, SHIPPED_DIR / name).model_dump()
        except ValueError:  # settings this version refuses: compare them as written
            pass
    return {**sparse, "config": name}


def _pooled_counters(counters: list[dict[str, Any]]) -> dict[str, Any]:
    """Page counters summed over runs, their shares recomputed from the sums."""
    counters = [c for c in counters if c]
    if not counters:
        return {}
    total = {k: sum(c.get(k, 0) for c in counters) for k in counters[0] if isinstance(counters[0][k], int)}
    if total.get("dense_pages"):
        total["attended_share"] = total.get("attended_pages", 0) / total["dense_pages"]
    if total.get("prefill_dense_pages"):
        total["prefill_attended_share"] = total.get("prefill_attended_pages", 0) / total["prefill_dense_pages"]
    return total


def pool_runs(out_dir: str | Path, *run_dirs: str | Path, command: str | None = None):
    """Pool ``run_dirs`` (each with a dense run, on disjoint prompts) into one report in ``out_dir``.

    Returns the pooled result (``vllm_sparse.eval.runner.EvalResult``); its ``summary.json`` lists the
    folders under ``pooled_from`` with each one's seed, samples, contexts, backends and machine (the report's
    ``machine`` is the first run's; its engine start and generate times are the runs' sums).

    Raises:
        PoolError: fewer than two folders, a folder without a dense run, settings that differ, or a prompt
            that two folders both ran.
    """
    if len(run_dirs) < 2:
        raise PoolError("pooling needs at least two runs")
    results = [load_result(d) for d in run_dirs]
    summaries = [json.loads((Path(d) / "summary.json").read_text()) for d in run_dirs]
    main = results[0]
    dense_labels = [next((r.backend.label for r in res.runs if not r.backend.is_sparse), None) for res in results]
    for d, label in zip(run_dirs, dense_labels, strict=True):
        if label is None:
            raise PoolError(f"{d}: no dense run; every pooled run needs its own dense reference")
    if len(set(dense_labels)) > 1:
        raise PoolError(f"the runs' dense backends differ: {dense_labels}")
    for d, res in zip(run_dirs[1:], results[1:], strict=True):
        for key in SAME_CONFIG:
            mine, theirs = getattr(main.config, key), getattr(res.config, key)
            if key == "tasks":
                mine, theirs = list(mine), list(theirs)
            if mine != theirs:
                raise PoolError(f"{d}: {key} is {theirs!r}, the first run's {mine!r}")

    sources = [  # before the first run's backends and contexts become the pooled ones
        {"dir": str(d), "seed": res.config.seed, "samples": res.config.samples, "contexts": list(res.config.contexts),
         "backends": [r.backend.label for r in res.runs], "machine": summary["machine"]}
        for d, res, summary in zip(run_dirs, results, summaries, strict=True)
    ]  # fmt: skip
    seen: dict[tuple, str] = {}
    pooled: dict[str, Any] = {}
    counters: dict[str, list[dict]] = {}
    for d, res in zip(run_dirs, results, strict=True):
        dense = next(r for r in res.runs if not r.backend.is_sparse)
        for rec in dense.records:
            sid = sample_id(rec)
            if sid in seen:
                raise PoolError(f"{d}: prompt {sid[:3]} was also run in {seen[sid]}; pooled runs need other prompts")
            seen[sid] = str(d)
        for run in res.runs:
            label = run.backend.label
            if label not in pooled:
                pooled[label] = run
                run.records = list(run.records)
                counters[label] = [run.page_counters]
                continue
            first = pooled[label]
            mine, theirs = _settings(first.backend), _settings(run.backend)
            if (first.backend.name, mine) != (run.backend.name, theirs):
                mine, theirs = mine or {}, theirs or {}
                keys = sorted(k for k in {**mine, **theirs} if mine.get(k) != theirs.get(k))
                raise PoolError(f"{d}: backend {label} ran other settings than in {run_dirs[0]} ({', '.join(keys)})")
            first.records += run.records
            first.start_s = round(first.start_s + run.start_s, 1)
            first.generate_s = round(first.generate_s + run.generate_s, 1)
            counters[label].append(run.page_counters)
    for label, run in pooled.items():
        run.page_counters = _pooled_counters(counters[label])

    main.runs = list(pooled.values())
    main.config.backends = [r.backend for r in main.runs]
    main.config.contexts = sorted({c for res in results for c in res.config.contexts})
    main.config.out_dir = str(out_dir)
    main.samples = samples_of(next(r for r in main.runs if not r.backend.is_sparse).records)
    pooled_cmd = command or "python -m vllm_sparse.eval.pool " + " ".join(
        shlex.quote(str(p)) for p in (out_dir, *run_dirs)
    )
    main.config.command = "; ".join([*(res.config.command or "" for res in results), pooled_cmd])
    write_report(main, machine=summaries[0]["machine"], extra={"pooled_from": sources})
    return main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_sparse.eval.pool", description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder for the pooled files")
    p.add_argument("runs", nargs="+", help="finished runs on other prompts, each with its dense reference")
    args = p.parse_args(argv)
    try:
        print(pool_runs(args.out, *args.runs).markdown)
    except PoolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
