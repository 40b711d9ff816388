"""Counters that prove sparsity is real: pages attended against pages a dense backend would read.

Counted per worker process, per layer and step. Set ``SPARSE_ATTENTION_STATS`` to a JSON path
and the worker rewrites it after every step (after the model's last layer); ``read_stats`` reads it.
Block-union selectors (``selectors.compact``) add per layer the blocks they keep at each union stage
(``record_unions``; ``block_unions`` in the snapshot).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass

import torch

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
_rank = 0  # tensor-parallel rank of this worker: rank r > 0 writes ``$SPARSE_ATTENTION_STATS.rank<r>``

#: the stages of a block-union selector (``selectors.compact``), as the paper's Table 2: blocks kept
#: per (query tile, query head) before any union, per query head after the union over the chunk's
#: tiles, per (request, KV head) after the union over the group's query heads
UNION_STAGES = ("tiles", "heads", "groups")
#: per layer, ``int64 [2 * len(UNION_STAGES)]`` (kept, scored) past blocks of each stage, summed over
#: the layer's forwards; on the selector's device (adding never syncs), read when a snapshot is taken
_unions: dict[int, torch.Tensor] = {}


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


def record_unions(layer: int, counts: torch.Tensor) -> None:
    """Add one layer forward's block-union counts: ``int64 [6]``, (kept, scored) past blocks per
    ``UNION_STAGES`` stage, on any device (kept there: no sync until a snapshot)."""
    with _lock:
        acc = _unions.get(layer)
        _unions[layer] = counts.clone() if acc is None else acc.add_(counts)


def _union_snapshot() -> dict:
    """Per layer (string keys, JSON), each stage's kept and scored blocks and its sparsity."""
    out = {}
    for layer, acc in sorted(_unions.items()):
        c = acc.tolist()
        out[str(layer)] = {
            stage: {
                "kept": c[2 * i],
                "scored": c[2 * i + 1],
                "sparsity": 1 - c[2 * i] / c[2 * i + 1] if c[2 * i + 1] else 0.0,
            }
            for i, stage in enumerate(UNION_STAGES)
        }
    return out


def record_meta_check(checked: int, mismatched: int) -> None:
    """Add one page metadata check's counts (``backend.meta_check``)."""
    with _lock:
        _counters.meta_checked_pages += checked
        _counters.meta_mismatched_pages += mismatched


def snapshot() -> dict:
    with _lock:
        d = asdict(_counters)
        unions = _union_snapshot()
    if unions:
        d["block_unions"] = unions
    d["attended_share"] = d["attended_pages"] / d["dense_pages"] if d["dense_pages"] else 1.0
    pd = d["prefill_dense_pages"]
    d["prefill_attended_share"] = d["prefill_attended_pages"] / pd if pd else 1.0
    return d


def reset() -> None:
    global _counters
    with _lock:
        _counters = PageCounters()
        _unions.clear()


def set_rank(rank: int) -> None:
    """This worker's tensor-parallel rank: each rank counts its own KV heads' rows; rank 0 writes
    ``$SPARSE_ATTENTION_STATS`` (what ``read_stats`` reads), rank ``r > 0`` the same path plus
    ``.rank<r>``."""
    global _rank
    _rank = rank


def flush() -> None:
    """Write the counters to ``$SPARSE_ATTENTION_STATS`` if set (atomic rename)."""
    path = os.environ.get(STATS_ENV)
    if not path:
        return
    if _rank:
        path = f"{path}.rank{_rank}"
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
