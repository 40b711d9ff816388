"""sparse_kascade (selectors/kascade.py, kernels/anchor_mass.py): the anchor mass against a brute-force
oracle, the reuse of an anchor's pages through the head map (planted keys), a covering budget equal to
dense through the selection path, the config's start-up reasons, and the CPU engine: greedy tokens equal
dense with a covering budget through the whole sparse path (force_sparse; chunked prefill with chunks
starting inside pages, mixed decode/prefill steps, prefix-cache hits), real sparsity at a real budget."""

from __future__ import annotations

import pytest
import torch
from helpers import brute_attention, gen, make_paged_batch, query_start_loc, randn, single_thread  # noqa: F401
from method_engine import (
    check_covering_gives_dense,
    check_fast_executor_gives_reference_tokens,
    check_real_completes_sparse,
    run_method_engines,
)

from vllm_sparse.config import SparseConfig
from vllm_sparse.executors import reference_executor
from vllm_sparse.kernels.anchor_mass import anchor_page_mass
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors import make_selector
from vllm_sparse.tables import build_page_tables


def brute_mass(q, k, ctx, n, scale, tile, starts=None):
    """Independent oracle: per query and head, float64 softmax over keys before its tile's start;
    ``starts``: the first query of each tile scored (None: every tile)."""
    c, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    past = ctx // n
    out = torch.zeros(hkv, past, dtype=torch.float64)
    for t0 in range(0, c, tile) if starts is None else starts:
        acc = torch.zeros(hkv, past, dtype=torch.float64)
        rows = 0
        for i in range(t0, min(t0 + tile, c)):
            rows += 1
            for h in range(hq):
                w = torch.softmax(q[i, h].double() @ k[: ctx + t0, h // g].double().T * scale, 0)
                acc[h // g] += w[: past * n].view(past, n).sum(1) / g
        out = torch.maximum(out, acc / rows)
    return out


@pytest.mark.parametrize("c,ctx,tile", [(1, 70, 32), (45, 40, 32), (9, 64, 4)])
def test_anchor_mass_matches_brute_force(c, ctx, tile):
    n, hkv, group, d = 16, 2, 3, 16
    b = make_paged_batch([ctx + c], hkv, n, d, seed=ctx + c)
    layout = PageLayout.of(b.kv_cache, hkv, b.order)
    pages = -(-(ctx + c) // n)
    ids = layout.page_ids(b.block_table[0, :pages].long()[None, :], torch.arange(hkv)[:, None])
    q = randn(c, hkv * group, d, g=gen(c))
    got = anchor_page_mass(q, layout.page_keys(b.kv_cache), ids, ctx, d**-0.5, tile)
    want = brute_mass(q, b.keys[0], ctx, n, d**-0.5, tile)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def test_anchor_window_scores_its_last_queries_over_every_key_before_them():
    """``chunk_query_window: W``: a chunk's anchor mass is the brute-force mass of its last W queries,
    which see the chunk's earlier keys too (their tiles start at the window), over the past pages only."""
    from vllm_sparse.selectors.kascade import score_request

    n, hkv, group, d, ctx, c, w = 16, 2, 3, 16, 75, 40, 9  # the chunk starts inside a page
    b = make_paged_batch([ctx + c], hkv, n, d, seed=11)
    layout = PageLayout.of(b.kv_cache, hkv, b.order)
    plan = plan_step(_config(force_sparse=True).for_layer(1), n, query_start_loc([c]), [ctx + c])
    q = randn(c, hkv * group, d, g=gen(12))
    got = score_request(q, layout.page_keys(b.kv_cache), b.block_table, layout, 0, plan.requests[0], d**-0.5, 4, w)
    want = brute_mass(q[c - w :], b.keys[0], ctx + c - w, n, d**-0.5, 4)[:, : ctx // n]
    assert got.shape == (hkv, ctx // n)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    full = score_request(q, layout.page_keys(b.kv_cache), b.block_table, layout, 0, plan.requests[0], d**-0.5, 4)
    assert not torch.allclose(full, got)  # (the window changes the mass: the test can fail)


@pytest.mark.parametrize(
    "c,tile,stride,want_tiles",
    [
        (45, 4, 3, [2, 5, 8, 11]),  # 12 tiles, the last one partial
        (40, 8, 3, [1, 4]),
        (40, 8, 9, [4]),  # a stride past the chunk: its last tile only
    ],
)
def test_anchor_tile_stride_scores_the_last_tile_and_every_strideth_before_it(c, tile, stride, want_tiles):
    """``kascade.tile_stride``: the mass is the brute-force mass over exactly the chunk's last tile and
    every ``stride``-th tile before it, each over every key before its first query. (Tile 0 is left
    out in every case: with random keys the earliest tile, which sees the fewest keys, weighs the
    past pages most and would decide the max alone.)"""
    from vllm_sparse.kernels.anchor_mass import scored_tiles
    from vllm_sparse.selectors.kascade import score_request

    starts = [t * tile for t in want_tiles]
    assert scored_tiles(c, tile, stride) == want_tiles
    n, hkv, group, d, ctx = 16, 2, 3, 16, 75  # the chunk starts inside a page
    b = make_paged_batch([ctx + c], hkv, n, d, seed=c + stride)
    layout = PageLayout.of(b.kv_cache, hkv, b.order)
    plan = plan_step(_config(force_sparse=True).for_layer(1), n, query_start_loc([c]), [ctx + c])
    q = randn(c, hkv * group, d, g=gen(stride))
    pk = layout.page_keys(b.kv_cache)
    got = score_request(q, pk, b.block_table, layout, 0, plan.requests[0], d**-0.5, tile, None, stride)
    want = brute_mass(q, b.keys[0], ctx, n, d**-0.5, tile, starts)
    assert got.shape == (hkv, ctx // n)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    every = score_request(q, pk, b.block_table, layout, 0, plan.requests[0], d**-0.5, tile)
    assert not torch.allclose(every, got)  # (the stride changes the mass: the test can fail)
    assert (every >= got - 1e-6).all()  # a max over fewer tiles


def test_selector_scores_anchors_with_the_config_tile_stride():
    """The anchor buffer holds the mass at the config's ``kascade.tile_stride``."""
    from vllm_sparse.selectors.kascade import score_request

    n, hkv, group, d, ctx, c = 16, 2, 2, 16, 96, 40
    cfg = _config(force_sparse=True, kascade={"anchors": [0, 2], "tile": 4, "tile_stride": 3})
    b = make_paged_batch([ctx + c], hkv, n, d, seed=21)
    layout = PageLayout.of(b.kv_cache, hkv, b.order)
    plan = plan_step(cfg.for_layer(2), n, query_start_loc([c]), [ctx + c])
    q = randn(c, hkv * group, d, g=gen(22))
    pk = layout.page_keys(b.kv_cache)
    make_selector(cfg, d**-0.5).for_layer(2, 4).observe(q, pk, b.block_table, layout, plan)
    req = plan.requests[0]
    strided = score_request(q, pk, b.block_table, layout, 0, req, d**-0.5, 4, None, 3)
    torch.testing.assert_close(plan.state.anchor.mass[0], strided)
    assert not torch.allclose(
        plan.state.anchor.mass[0], score_request(q, pk, b.block_table, layout, 0, req, d**-0.5, 4)
    )


def _config(**kw):
    base = {"method": "kascade", "sink_tokens": 0, "local_tokens": 0, "dense_below_tokens": 0, "dense_layers": [0]}
    return SparseConfig(**{**base, **kw})


def test_reuse_layer_reads_the_anchor_heads_through_the_head_map():
    """Plant one heavy key per KV head, in a different page each: the anchor picks each head's own
    page, a reuse layer with a swapped head map picks the other head's."""
    n, hkv, group, d, ctx = 16, 2, 2, 16, 160
    cfg = _config(
        budget={"fraction": 0.1, "min_tokens": 16, "max_tokens": None},
        kascade={"anchors": [0, 2], "head_map": {1: [1, 0]}},
    )
    b = make_paged_batch([ctx + 1], hkv, n, d, seed=3)
    layout = PageLayout.of(b.kv_cache, hkv, b.order)
    page_keys = layout.page_keys(b.kv_cache)
    direction = randn(hkv, d, g=gen(5))
    planted = {0: 3, 1: 7}
    for h, pg in planted.items():
        layout.keys(b.kv_cache)[int(b.block_table[0, pg]), h, 5] = 8 * direction[h]
    q = 0.1 * randn(1, hkv * group, d, g=gen(6))
    for h in range(hkv):
        q[0, h * group : (h + 1) * group] += direction[h]
    base = make_selector(cfg, d**-0.5)
    anchor, reuse = base.for_layer(0, 4), base.for_layer(1, 4)
    plan = plan_step(cfg.for_layer(1), n, query_start_loc([1]), [ctx + 1])
    assert plan.requests[0].sparse and plan.requests[0].num_select == 1
    anchor.observe(q, page_keys, b.block_table, layout, plan)  # layer 0: dense, scores
    reuse.observe(q, page_keys, b.block_table, layout, plan)  # layer 1: reuse, nothing to score
    own = anchor(q, page_keys, b.block_table, layout, plan)
    swapped = reuse(q, page_keys, b.block_table, layout, plan)
    assert own.indices[:, 0].tolist() == [planted[0], planted[1]]
    assert swapped.indices[:, 0].tolist() == [planted[1], planted[0]]
    assert plan.state.anchor.layer == 0


def test_reuse_without_its_anchor_this_step_raises():
    cfg = _config(kascade={"anchors": [0, 2]}, force_sparse=True)
    b = make_paged_batch([100], 2, 16, 16, seed=1)
    layout = PageLayout.of(b.kv_cache, 2, b.order)
    plan = plan_step(cfg.for_layer(3), 16, query_start_loc([20]), [100])
    sel = make_selector(cfg).for_layer(3, 4)
    with pytest.raises(RuntimeError, match="reuses anchor layer 2"):
        sel(randn(20, 4, 16, g=gen(1)), layout.page_keys(b.kv_cache), b.block_table, layout, plan)


def test_covering_budget_equals_dense_through_the_selection_path():
    """force_sparse with a budget covering the context: every past page selected, anchor and reuse
    layers alike (mixed batch: a decode and two chunks, one starting inside a page)."""
    n, hkv, group, d = 16, 2, 2, 16
    seq, qlens = [97, 150, 70], [1, 30, 7]
    cfg = _config(budget={"fraction": 1.0, "min_tokens": 0}, dense_layers=[], force_sparse=True,
                  kascade={"anchors": [0, 2], "head_map": {1: [1, 1], 3: [0, 0]}})  # fmt: skip
    b = make_paged_batch(seq, hkv, n, d, seed=9)
    layout = PageLayout.of(b.kv_cache, hkv, b.order)
    pk, pv = layout.page_keys(b.kv_cache), layout.page_values(b.kv_cache)
    qsl = query_start_loc(qlens)
    query = randn(qsl[-1], hkv * group, d, g=gen(2))
    base = make_selector(cfg, d**-0.5)
    plan = plan_step(cfg.for_layer(1), n, qsl, seq)
    assert all(r.sparse and r.num_select == r.num_past_pages for r in plan.requests)
    for layer in range(4):
        sel = base.for_layer(layer, 4)
        sel.observe(query, pk, b.block_table, layout, plan)
        selection = sel(query, pk, b.block_table, layout, plan)
        out = torch.empty_like(query)
        reference_executor(query, pk, pv, build_page_tables(plan, selection, b.block_table, layout), plan, d**-0.5, out)
        for r, (s, ql) in enumerate(zip(seq, qlens)):
            want = brute_attention(query[qsl[r] : qsl[r + 1]], b.keys[r], b.values[r], s - ql, d**-0.5, page_size=n)
            torch.testing.assert_close(out[qsl[r] : qsl[r + 1]].double(), want, atol=1e-4, rtol=1e-4)


def test_config_reasons():
    assert "vllm-sparse calibrate" in " ".join(_config().model_reasons(24, 2))
    assert _config(kascade={"anchors": "evenly_spaced", "num_anchors": 4}).kascade.anchor_layers(24) == [0, 6, 12, 18]
    assert _config(kascade={"anchors": "evenly_spaced"}).model_reasons(24, 2) == []
    reasons = _config(kascade={"anchors": [2, 1, 30], "head_map": {1: [0, 5], 2: [0, 0]}}).model_reasons(24, 2)
    text = "\n".join(reasons)
    for needle in (
        "must start with layer 0",
        "strictly increasing",
        "[30] not layers",
        "key 2 is not a reuse",
        "head_map.1",
    ):
        assert needle in text, (needle, text)


def test_kv_heads_of_rank_follow_vllms_sharding():
    from vllm_sparse.config import kv_heads_of_rank

    assert [kv_heads_of_rank(8, 2, r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [kv_heads_of_rank(2, 2, r) for r in range(2)] == [[0], [1]]
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]  # replicated heads
    assert kv_heads_of_rank(4, 1, 0) == [0, 1, 2, 3]


def test_head_map_under_tensor_parallelism():
    """Each worker reads its own KV heads' map in local indices; maps that stay inside every rank's
    heads are accepted, and one that crosses ranks is refused at start with the heads named."""
    within = _config(kascade={"anchors": [0, 2], "head_map": {1: [1, 0, 3, 2], 3: [0, 0, 2, 2]}})
    opts = within.kascade
    assert within.model_reasons(4, 4, tp_size=2) == []
    assert opts.local_head_map(1, [0, 1]) == [1, 0] and opts.local_head_map(1, [2, 3]) == [1, 0]
    assert opts.local_head_map(3, [0, 1]) == [0, 0] and opts.local_head_map(3, [2, 3]) == [0, 0]
    assert opts.local_head_map(1, None) == [1, 0, 3, 2]  # no tensor parallelism: the model's map
    assert opts.local_head_map(2, [2, 3]) is None  # an anchor / a layer without a map: identity
    identity = _config(kascade={"anchors": [0, 2], "head_map": {1: [0, 1, 2, 3]}}).kascade
    assert identity.local_head_map(1, [2, 3]) is None
    crossing = _config(kascade={"anchors": [0, 2], "head_map": {1: [2, 1, 0, 3], 3: [0, 1, 2, 3]}})
    assert crossing.model_reasons(4, 4, tp_size=1) == []
    reasons = crossing.model_reasons(4, 4, tp_size=2)
    assert len(reasons) == 1 and "head_map.1" in reasons[0] and "0->2, 2->0" in reasons[0], reasons
    assert "--tensor-parallel-size 2" in reasons[0]
    # more ranks than KV heads: every rank holds one head, so only the identity fits
    assert _config(kascade={"anchors": [0, 2], "head_map": {1: [1, 0]}}).model_reasons(4, 2, tp_size=4)
    assert _config(kascade={"anchors": [0, 2], "head_map": {1: [0, 1]}}).model_reasons(4, 2, tp_size=4) == []


def test_decodes_take_the_device_path_on_gpus(monkeypatch):
    """Kascade decodes on the device-driven path (full CUDA graphs for decode batches), unless the
    config asks for the torch reference executor; its anchors then hand their scores on through
    the step's anchor buffer (tests/test_decode_path.py)."""
    from types import SimpleNamespace

    from vllm_sparse.backend import metadata

    monkeypatch.setattr(metadata.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(metadata.importlib.util, "find_spec", lambda name: object())

    def engine(name, extra=None):
        backend = SimpleNamespace(name=name)
        return SimpleNamespace(
            attention_config=SimpleNamespace(backend=backend), additional_config=extra or {}, model_config=None
        )

    anchors = {"sparse_attention": {"kascade": {"anchors": [0, 2]}}}
    assert metadata.device_decode_supported(engine("SPARSE_KASCADE", anchors))
    assert metadata.device_decode_supported(engine("SPARSE_QUEST"))
    reference = {"sparse_attention": {"kascade": {"anchors": [0, 2]}, "executor": "reference"}}
    assert not metadata.device_decode_supported(engine("SPARSE_KASCADE", reference))


# ---------------------------------------------------------------------------------------------
# The CPU engine
# ---------------------------------------------------------------------------------------------

GEN_TOKENS = 32
KASCADE = {"anchors": [0, 2], "head_map": {"1": [1, 0], "3": [0, 0]}}


@pytest.fixture(scope="module")
def engine_results(tiny_llama, run_engines):
    full = {"budget": {"fraction": 1.0, "min_tokens": 0}, "dense_layers": [], "dense_below_tokens": 0,
            "force_sparse": True, "kascade": KASCADE}  # fmt: skip
    real = {"budget": {"fraction": 0.25, "min_tokens": 64, "max_tokens": None}, "sink_tokens": 32, "local_tokens": 64,
            "dense_layers": [0], "dense_below_tokens": 256, "kascade": {"anchors": "evenly_spaced", "num_anchors": 2}}  # fmt: skip
    return run_method_engines(run_engines, tiny_llama, "sparse_kascade", full, real, GEN_TOKENS)


@pytest.mark.engine
def test_engine_covering_budget_gives_dense_tokens(engine_results):
    check_covering_gives_dense(engine_results, GEN_TOKENS)


@pytest.mark.engine
def test_engine_fast_executor_gives_the_reference_executors_tokens(engine_results):
    check_fast_executor_gives_reference_tokens(engine_results)


@pytest.mark.engine
def test_engine_real_budget_skips_pages_and_completes(engine_results):
    s = check_real_completes_sparse(engine_results, GEN_TOKENS)
    assert s["attended_pages"] < 0.85 * s["dense_pages"], s
