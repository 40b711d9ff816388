"""The prefill cost decision: which chunks run sparse, per config switch and per cost model."""

from __future__ import annotations

import pytest

from vllm_sparse.config import SparseConfig
from vllm_sparse.cost import COEFFICIENTS, PrefillCost, cost_method, prefill_cost, scoring_queries
from vllm_sparse.policy import plan_request

N = 16
# a model whose selection costs a fixed 0.2 ms per layer: sparse pays only on long contexts
MODEL = PrefillCost(dense_a=1.0, attend_b=1.2, score_c=0.0, per_query_e=0.0, fixed_f=200.0)


def test_model_break_even_moves_with_context():
    kept = 2048
    assert not MODEL.sparse_pays(2048, 4096, kept)
    assert MODEL.sparse_pays(8192, 65536, kept)
    pays = [MODEL.sparse_pays(8192, ctx, kept) for ctx in (4096, 8192, 16384, 32768, 65536)]
    assert pays == sorted(pays) and pays[0] is False and pays[-1] is True, pays


@pytest.mark.parametrize(
    "switch,verdict,expect_sparse",
    [
        (None, True, True),
        (None, False, False),  # auto: the cost model says dense
        (True, False, True),  # forced on: the model is not asked
        (False, True, False),  # forced off
    ],
)
def test_switch_and_model_decide_prefill(switch, verdict, expect_sparse):
    policy = SparseConfig(method="quest", sparse_prefill=switch).for_layer(1)
    asked = []

    def pays(q, ctx, kept):
        asked.append((q, ctx, kept))
        return verdict

    plan = plan_request(policy, N, 0, 2048, 32768 + 2048, pays)
    assert plan.sparse is expect_sparse
    if switch is None:
        (q, ctx, kept), = asked
        assert (q, ctx) == (2048, 32768)
        assert kept == (plan.num_select + 1 + 512 // N) * N if plan.sparse else kept > 0


def test_decode_rows_and_forced_sparse_ignore_the_model():
    never = lambda *a: False  # noqa: E731
    quest = SparseConfig(method="quest").for_layer(1)
    assert plan_request(quest, N, 0, 1, 40000, never).sparse  # decode: not a prefill decision
    forced = SparseConfig(method="quest", force_sparse=True).for_layer(1)
    assert plan_request(forced, N, 0, 512, 40000, never).sparse


def test_scoring_queries_per_method():
    assert scoring_queries(SparseConfig(method="quoka", quoka={"num_queries": 32})) == 32
    bounds = {"prefill_scores": "bounds"}
    assert scoring_queries(SparseConfig(method="quest", quest=bounds)) == 64  # the default chunk_query_window
    assert scoring_queries(SparseConfig(method="quest", quest=bounds, chunk_query_window=0)) is None
    pruned = {"prune_prefill": True}
    assert scoring_queries(SparseConfig(method="twilight", twilight=pruned)) == 64
    assert scoring_queries(SparseConfig(method="quest", quest=bounds, chunk_query_window=128)) == 128
    # Quest's default ranks a chunk's pages by QuoKA's exact scores: QuoKA's scoring queries and model
    exact = SparseConfig(method="quest", quoka={"num_queries": 32}, chunk_query_window=0)
    assert scoring_queries(exact) == 32
    assert cost_method(exact) == "quoka" and cost_method(SparseConfig(method="quest", quest=bounds)) == "quest"
    # Twilight's chunks: pruned, its own model; unpruned (the default), its candidates' selector alone
    assert cost_method(SparseConfig(method="twilight", twilight=pruned)) == "twilight"
    assert cost_method(SparseConfig(method="twilight")) == "quoka"  # Quest candidates ranked by exact scores
    assert cost_method(SparseConfig(method="twilight", quest=bounds)) == "quest"
    assert cost_method(SparseConfig(method="twilight", twilight={"candidates": "quoka"})) == "quoka"
    assert scoring_queries(SparseConfig(method="twilight", quoka={"num_queries": 32})) == 32
    h100 = "NVIDIA H100 80GB HBM3"
    assert prefill_cost(exact, h100) == prefill_cost(SparseConfig(method="quoka", quoka={"num_queries": 32}), h100)


def test_unknown_gpu_has_no_model():
    assert prefill_cost(SparseConfig(method="quest"), "Tesla T4") is None
    for (family, method), coeffs in COEFFICIENTS.items():
        assert family == "hopper" and len(coeffs) == 5
        assert prefill_cost(SparseConfig(method=method), "NVIDIA H100 80GB HBM3") is not None
