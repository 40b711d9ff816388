"""benchmarks/accuracy_overview.py: the shipped configs' accuracy read from the eval runs named in a sources file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from accuracy_overview import main, read_cells  # noqa: E402


def write_run(folder: Path, rows: list[tuple[str, str, int, float]]) -> str:
    """A run folder whose summary holds paired-difference rows ``(backend, task, context, difference)``."""
    folder.mkdir(parents=True)
    paired = [
        {"backend": b, "task": t, "context": c, "difference": d, "n": 80, "ci95": [d - 0.02, d + 0.01]}
        for b, t, c, d in rows
    ]
    (folder / "summary.json").write_text(json.dumps({"paired_difference": paired}))
    return f"{folder.name}/summary.json"


def test_cells_take_the_backends_all_tasks_row_at_their_context(tmp_path):
    run = write_run(
        tmp_path / "run",
        [
            ("sparse_quest@0.25", "vt", 32768, -0.5),  # one task only: not the cell's row
            ("sparse_quest@0.25", "all tasks", 16384, -0.25),  # another context
            ("sparse_quest@0.25", "all tasks", 32768, -0.04),
            ("sparse_quest@0.25+sum", "all tasks", 32768, -0.03),  # another label
        ],
    )
    cell = {"model": "m", "method": "Quest", "context": 32768, "summary": run, "backend": "sparse_quest@0.25"}
    (tmp_path / "sources.json").write_text(json.dumps({"what": "t", "cells": [cell]}))
    assert main([str(tmp_path / "sources.json")]) == 0
    out = json.loads((tmp_path / "accuracy_overview.json").read_text())["cells"]
    assert [(c["difference"], c["n"]) for c in out] == [(-0.04, 80)]
    assert out[0]["ci95"] == pytest.approx([-0.06, -0.03])
    assert (tmp_path / "accuracy_overview.png").stat().st_size > 0


def test_a_cell_its_run_does_not_hold_is_an_error(tmp_path):
    run = write_run(tmp_path / "run", [("sparse_quoka@0.25", "all tasks", 16384, 0.0)])
    cell = {"model": "m", "method": "QuoKA", "context": 32768, "summary": run, "backend": "sparse_quoka@0.25"}
    (tmp_path / "sources.json").write_text(json.dumps({"cells": [cell]}))
    with pytest.raises(ValueError, match="no 'all tasks' row for sparse_quoka@0.25 at 32768"):
        read_cells(tmp_path / "sources.json")


def test_the_recorded_overview_matches_its_sources():
    """The committed overview is what its sources file reads from the committed runs."""
    sources = Path(__file__).resolve().parents[1] / "benchmarks/results/accuracy_overview/sources.json"
    recorded = json.loads((sources.parent / "accuracy_overview.json").read_text())["cells"]
    assert read_cells(sources) == recorded
