"""Eval records grouped into report cells (backend, task, context), each with its statistics.

A record is one (backend, sample) result as ``samples.json`` holds it: ``backend``, ``task``,
``context``, ``index``, ``prompt_hash``, ``score`` (see ``runner.run_backend``).

* :func:`accuracy_table`: per (backend, task, context) the mean score with its 95% interval
  (``intervals.mean_interval``); task ``ALL`` pools every sample of the context (with the same
  number of samples per task, as every run has, that is the mean over tasks).
* :func:`paired_table`: per (sparse backend, task, context) the difference to the dense backend
  on the same prompts (same task, context, sample index and prompt hash) with its paired 95%
  interval (``intervals.paired_difference``); samples only one side has are left out and counted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from vllm_sparse.eval.intervals import Interval, mean_interval, paired_difference

ALL = "all tasks"
Key = tuple[str, str, int]  # (backend, task, context)


def sample_id(record: dict[str, Any]) -> tuple:
    """What makes two records the same prompt: task, context, sample index and prompt hash."""
    return record["task"], record["context"], record["index"], record.get("prompt_hash")


def _scores_by_cell(records: Iterable[dict[str, Any]]) -> dict[Key, dict[tuple, float]]:
    """``{(backend, task, context): {sample id: score}}``, plus ``ALL`` cells pooling each context."""
    cells: dict[Key, dict[tuple, float]] = defaultdict(dict)
    for r in records:
        sid = sample_id(r)
        cells[(r["backend"], r["task"], r["context"])][sid] = float(r["score"])
        cells[(r["backend"], ALL, r["context"])][sid] = float(r["score"])
    return cells


def accuracy_table(records: Iterable[dict[str, Any]]) -> dict[Key, Interval]:
    """Mean score, sample count and Wilson 95% interval per (backend, task, context)."""
    return {k: mean_interval(list(v.values())) for k, v in _scores_by_cell(records).items()}


def paired_table(records: Iterable[dict[str, Any]], dense: str) -> dict[Key, tuple[Interval, int]]:
    """Per (backend, task, context) of every backend but ``dense``: the paired difference to
    ``dense`` (sparse minus dense) and how many of the backend's samples had no dense twin."""
    cells = _scores_by_cell(records)
    out: dict[Key, tuple[Interval, int]] = {}
    for (backend, task, ctx), scores in cells.items():
        base = cells.get((dense, task, ctx))
        if backend == dense or not base:
            continue
        shared = [sid for sid in scores if sid in base]
        if shared:
            diff = paired_difference([scores[s] for s in shared], [base[s] for s in shared])
            out[(backend, task, ctx)] = (diff, len(scores) - len(shared))
    return out
