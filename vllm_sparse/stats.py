"""Counters that prove sparsity is real: pages attended against pages a dense backend would read.

Counted per worker process, per layer and step. Set ``SPARSE_ATTENTION_STATS`` to a JSON path
and the worker rewrites it after every step (after the model's last layer); ``read_stats`` reads it.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass

STATS_ENV = "SPARSE_ATTENTION_STATS"


@dataclass
class PageCounters:
    steps: int = 0  # layer forwards that ran through the pipeline
    sparse_rows: int = 0  # (request, KV head) rows that were sparse
    attended_pages: int = 0  # sum over rows of pages attended
    dense_pages: int = 0  # sum over rows of pages a dense backend attends
    # the same two over prefill rows only (query length > 1), from the step plan: decode steps
    # of QuoKA are dense by default, and they would otherwise dominate the share
    prefill_attended_pages: int = 0
    prefill_dense_pages: int = 0
    # the page metadata debug check (``backend.meta_check``, SPARSE_ATTENTION_CHECK_META=1)
    meta_checked_pages: int = 0  # (page, layer) summaries recomputed from their keys and compared
    meta_mismatched_pages: int = 0  # of those, summaries that differed from the recompute

    @property
    def attended_share(self) -> float:
        return self.attended_pages / self.dense_pages if self.dense_pages else 1.0


_lock = threading.Lock()
_counters = PageCounters()


def enabled() -> bool:
    """Whether the counters are written anywhere (``$SPARSE_ATTENTION_STATS`` set)."""
    return bool(os.environ.get(STATS_ENV))


def record(
    sparse_rows: int,
    attended_pages: int,
    dense_pages: int,
    prefill_attended: int = 0,
    prefill_dense: int = 0,
    steps: int = 1,
) -> None:
    """Add one layer forward's counts (``steps``: that many layer forwards, summed)."""
    with _lock:
        _counters.steps += steps
        _counters.sparse_rows += sparse_rows
        _counters.attended_pages += attended_pages
        _counters.dense_pages += dense_pages
        _counters.prefill_attended_pages += prefill_attended
        _counters.prefill_dense_pages += prefill_dense


def record_meta_check(checked: int, mismatched: int) -> None:
    """Add one page metadata check's counts (``backend.meta_check``)."""
    with _lock:
        _counters.meta_checked_pages += checked
        _counters.meta_mismatched_pages += mismatched


def snapshot() -> dict:
    with _lock:
        d = asdict(_counters)
    d["attended_share"] = d["attended_pages"] / d["dense_pages"] if d["dense_pages"] else 1.0
    pd = d["prefill_dense_pages"]
    d["prefill_attended_share"] = d["prefill_attended_pages"] / pd if pd else 1.0
    return d


def reset() -> None:
    global _counters
    with _lock:
        _counters = PageCounters()


def flush() -> None:
    """Write the counters to ``$SPARSE_ATTENTION_STATS`` if set (atomic rename)."""
    path = os.environ.get(STATS_ENV)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(snapshot(), f)
    os.replace(tmp, path)


def read_stats(path: str) -> dict:
    """The counters last flushed to ``path`` (empty counters if none were written yet)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {**asdict(PageCounters()), "attended_share": 1.0, "prefill_attended_share": 1.0}
