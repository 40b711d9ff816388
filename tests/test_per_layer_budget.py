"""benchmarks/per_layer_budget.py: the concave hull, interpolation and the greedy split of pages over layers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from per_layer_budget import interp, layer_curves, split_pages, upper_hull  # noqa: E402


def test_upper_hull_drops_points_below_the_chord_and_keeps_the_best_of_equal_x():
    pts = [(1, 0.5), (2, 0.55), (3, 0.8), (4, 0.85), (4, 0.9)]
    assert upper_hull(pts) == [(1, 0.5), (3, 0.8), (4, 0.9)]  # (2, 0.55) lies below the chord 1 -> 3


def test_interp_is_piecewise_linear_and_clamped():
    xs, ys = [1.0, 3.0, 5.0], [0.0, 1.0, 2.0]
    assert interp(2.0, xs, ys) == 0.5 and interp(4.0, xs, ys) == 1.5
    assert interp(0.0, xs, ys) == 0.0 and interp(9.0, xs, ys) == 2.0


def test_split_gives_pages_where_recall_rises_most_and_keeps_the_total():
    hulls = {
        1: [(10.0, 0.70), (20.0, 0.90), (40.0, 0.95)],  # steep first
        2: [(10.0, 0.95), (20.0, 0.96), (40.0, 0.97)],  # nearly flat
    }
    pages = split_pages(hulls, 40.0, 1.0)
    assert pages == pytest.approx({1: 30.0, 2: 10.0})
    # the uniform split (20 + 20) predicts 0.90 + 0.96; this one 0.925 + 0.95, more in all
    assert interp(30.0, [10, 20, 40], [0.70, 0.90, 0.95]) + 0.95 > 0.90 + 0.96
    with pytest.raises(ValueError, match="fewer than the smallest"):
        split_pages(hulls, 15.0, 1.0)
    with pytest.raises(ValueError, match="exceed"):
        split_pages(hulls, 90.0, 1.0)


def test_curves_average_over_prompts_and_phases_per_budget_and_skip_dense_layers():
    def rec(layer, budget, recall, selected, phase="decode", dense=False, method="quest"):
        return {"method": method, "phase": phase, "dense_layer": dense, "layer": layer, "budget": budget,
                "recall": recall, "selected_pages": [selected, selected], "forced_pages": 2}  # fmt: skip

    records = [rec(1, 0.25, 0.8, 10), rec(1, 0.25, 0.6, 10, phase="prefill"), rec(1, 0.125, 0.5, 4),
               rec(0, 0.25, 1.0, 10, dense=True), rec(1, 0.25, 0.1, 10, method="quoka"),
               rec(1, 0.5, 0.9, 20, phase="prefill_last"), rec(1, 0.0625, 0.5, 4)]  # fmt: skip
    curves = layer_curves(records, "quest", ["decode", "prefill"])
    assert list(curves) == [1]
    # 0.0625 attends what 0.125 does (its min_tokens): the larger budget stands for those pages
    assert curves[1] == [(6.0, 0.5, 0.125), (12.0, pytest.approx(0.7), 0.25)]
