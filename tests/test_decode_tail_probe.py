"""benchmarks/decode_tail_probe.py: the decode rules it compares, on random tensors (no model)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from decode_tail_probe import Rule  # noqa: E402

HKV, G, D, N = 2, 3, 16, 4


def tensors(seq: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HKV * G, 1, D, generator=gen)
    k = torch.randn(1, HKV, seq, D, generator=gen)
    v = torch.randn(1, HKV, seq, D, generator=gen)
    return q, k, v


def dense(q, k, v):
    return Rule("dense", 1.0, N, 0, 0).forward(5, q, k, v, D**-0.5)


@pytest.mark.parametrize("name", ["oracle", "quest", "oracle+mean", "quest+mean", "oracle-heads"])
def test_a_covering_budget_is_dense(name):
    q, k, v = tensors(seq=10 * N + 2)  # a partial last page
    out = Rule(name, 1.0, N, sink=N, local=N).forward(5, q, k, v, D**-0.5)
    torch.testing.assert_close(out, dense(q, k, v))


def test_dense_layers_and_the_page_count():
    q, k, v = tensors(seq=40 * N)
    rule = Rule("quest", 0.25, N, sink=N, local=2 * N)
    torch.testing.assert_close(rule.forward(0, q, k, v, D**-0.5), dense(q, k, v))  # layer 0 is dense
    rule.forward(5, q, k, v, D**-0.5)
    assert rule.kept_share == [pytest.approx((1 + 2 + 10) / 40)]  # sink, local window, 25% of the context


def test_the_mean_pages_estimate_the_dropped_mass():
    """Keys that repeat within a page make the pseudo-key exact: a page's mean key and value stand for its tokens,
    so attending them with the log of the count restores dense attention where dropping them does not."""
    q, k, v = tensors(seq=32 * N, seed=3)
    k = k[:, :, ::N].repeat_interleave(N, 2)
    v = v[:, :, ::N].repeat_interleave(N, 2)
    ref = dense(q, k, v)
    dropped = Rule("oracle", 0.25, N, sink=N, local=N).forward(5, q, k, v, D**-0.5)
    estimated = Rule("oracle+mean", 0.25, N, sink=N, local=N).forward(5, q, k, v, D**-0.5)
    torch.testing.assert_close(estimated, ref)
    assert (dropped - ref).abs().max() > 1e-3


def test_a_variant_may_name_its_budget():
    rule = Rule("oracle-heads@0.5", 0.25, N, sink=N, local=N)
    assert (rule.name, rule.budget) == ("oracle-heads", 0.5)


def test_a_variant_may_name_more_dense_layers():
    rule = Rule("oracle@0.5:dense=3-5,9", 0.25, N, sink=N, local=N)
    assert (rule.name, rule.budget, rule.dense_layers) == ("oracle", 0.5, {0, 3, 4, 5, 9})
    q, k, v = tensors(seq=40 * N)
    torch.testing.assert_close(rule.forward(4, q, k, v, D**-0.5), dense(q, k, v))
    assert (rule.forward(6, q, k, v, D**-0.5) - dense(q, k, v)).abs().max() > 1e-3
