"""Page counters (vllm_sparse/stats.py): shares over all rows and over prefill rows, the stats file."""

from __future__ import annotations

import json

import pytest

from vllm_sparse import stats


@pytest.fixture(autouse=True)
def fresh_counters():
    stats.reset()
    yield
    stats.reset()


def test_shares_over_all_rows_and_prefill_rows(tmp_path, monkeypatch):
    stats.record(sparse_rows=2, attended_pages=30, dense_pages=100, prefill_attended=10, prefill_dense=60)
    stats.record(sparse_rows=0, attended_pages=40, dense_pages=40)  # a dense decode step
    snap = stats.snapshot()
    assert snap["steps"] == 2 and snap["sparse_rows"] == 2
    assert snap["attended_share"] == pytest.approx(70 / 140)
    assert snap["prefill_attended_share"] == pytest.approx(10 / 60)
    path = tmp_path / "stats.json"
    monkeypatch.setenv(stats.STATS_ENV, str(path))
    stats.flush()
    assert json.loads(path.read_text()) == snap == stats.read_stats(str(path))


def test_no_rows_means_share_one(tmp_path):
    assert stats.snapshot()["attended_share"] == 1.0 and stats.snapshot()["prefill_attended_share"] == 1.0
    missing = stats.read_stats(str(tmp_path / "none.json"))
    assert missing["attended_pages"] == 0 and missing["prefill_attended_share"] == 1.0
