"""sparse_compact (selectors/compact.py): FlashPrefill's tile decisions against a float64 oracle, the
unions against a brute-force search for the smallest table keeping every selected block, the pages a
row gets (blocks, the diagonal block, forced pages left to the tables), a zero threshold equal to
dense through the selection path (mixed batch), real sparsity on planted keys, the per-layer union
counters, the policy (no budget), the start-up refusals, and the CPU engine: greedy tokens equal
dense at a zero threshold through the whole sparse path (force_sparse), pages skipped at a real one."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import brute_attention, gen, make_paged_batch, query_start_loc, randn, single_thread  # noqa: F401
from method_engine import (
    check_covering_gives_dense,
    check_fast_executor_gives_reference_tokens,
    check_real_completes_sparse,
    run_method_engines,
)

from vllm_sparse import stats
from vllm_sparse.config import SparseConfig
from vllm_sparse.executors import reference_executor
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors import make_selector
from vllm_sparse.selectors.compact import block_means, tile_block_keep, union_counts
from vllm_sparse.tables import build_page_tables


def oracle_tile_keep(q, keys, first_pos, block_tokens, num_past_blocks, scale, alpha, tile):
    """FlashPrefill's rule element by element in float64, normalised scores and all:
    ``bool [Hkv, G, T, nbp]`` from token keys ``[S, Hkv, D]``."""
    c, hq, d = q.shape
    hkv = keys.shape[1]
    g, nb = hq // hkv, keys.shape[0] // block_tokens
    mean = keys[: nb * block_tokens].double().view(nb, block_tokens, hkv, d).mean(1)  # [nb, Hkv, D]
    t = -(-c // tile)
    out = torch.zeros(hkv, g, t, num_past_blocks, dtype=torch.bool)
    for h in range(hq):
        for ti in range(t):
            m = torch.full((nb,), float("-inf"), dtype=torch.float64)
            s_sum = torch.zeros(nb, dtype=torch.float64)
            rows = range(ti * tile, min((ti + 1) * tile, c))
            for j in range(nb):
                logits = [
                    float(q[i, h].double() @ mean[j, h // g]) * scale
                    for i in rows
                    if (j + 1) * block_tokens <= first_pos + i + 1
                ]
                if logits:
                    m[j] = max(logits)
                    s_sum[j] = sum(math.exp(x - float(m[j])) for x in logits)
            w = torch.where(torch.isfinite(m), s_sum * torch.exp(m - m.max()), torch.zeros_like(m))
            score = w / w.sum()
            out[h // g, h % g, ti] = score[:num_past_blocks] >= alpha * score.max()
    return out


@pytest.mark.parametrize(
    "c,ctx,bp,tile,alpha",
    [(40, 120, 2, 16, 0.5), (70, 200, 1, 32, 0.8), (9, 260, 3, 4, 0.3), (130, 64, 2, 128, 0.6)],
)
def test_tile_decisions_match_the_oracle(c, ctx, bp, tile, alpha):
    """Chunks that start inside a block and hold complete blocks of their own (which count for the
    rows after them only), tiles that do not divide the chunk, one tile wider than it."""
    n, hkv, g, d = 16, 2, 3, 16
    seq = ctx + c
    b = make_paged_batch([seq], hkv, n, d, seed=c)
    layout = PageLayout.of(b.kv_cache, hkv, b.order)
    nb = seq // (bp * n)
    ids = layout.page_ids(b.block_table[0, : nb * bp].long()[None, :], torch.arange(hkv)[:, None])
    mean_k = block_means(layout.page_keys(b.kv_cache), ids, bp)
    q = randn(c, hkv * g, d, g=gen(c + 1)) * 3  # sharp enough that blocks differ
    nbp = ctx // (bp * n)
    got = tile_block_keep(q, mean_k, ctx, bp * n, nbp, d**-0.5, alpha, tile)
    want = oracle_tile_keep(q, b.keys[0], ctx, bp * n, nbp, d**-0.5, alpha, tile)
    assert torch.equal(got, want)
    assert 0 < int(got.sum()) < got.numel(), "the case decides something (the test can fail)"


def test_slices_give_what_one_pass_gives(monkeypatch):
    """The block means gathered a block at a time and the scores computed a tile at a time (the
    memory bounds) equal one pass, and the means equal the token keys' means."""
    from vllm_sparse.kernels import block_scores
    from vllm_sparse.selectors import compact

    n, hkv, d, bp, seq = 16, 2, 16, 2, 700
    b = make_paged_batch([seq], hkv, n, d, seed=3)
    layout = PageLayout.of(b.kv_cache, hkv, b.order)
    nb = seq // (bp * n)
    ids = layout.page_ids(b.block_table[0, : nb * bp].long()[None, :], torch.arange(hkv)[:, None])
    q = randn(100, hkv * 4, d, g=gen(4)) * 3
    whole = block_means(layout.page_keys(b.kv_cache), ids, bp)
    keep = tile_block_keep(q, whole, 600, bp * n, 18, d**-0.5, 0.5, 16)
    monkeypatch.setattr(compact, "MEAN_ELEMENTS", 1)
    monkeypatch.setattr(block_scores, "SCORE_ELEMENTS", 1)
    sliced = block_means(layout.page_keys(b.kv_cache), ids, bp)
    assert torch.equal(sliced, whole)
    assert torch.equal(tile_block_keep(q, sliced, 600, bp * n, 18, d**-0.5, 0.5, 16), keep)
    tokens = b.keys[0][: nb * bp * n].double().view(nb, bp * n, hkv, d).mean(1).transpose(0, 1)
    torch.testing.assert_close(whole.double(), tokens)


def smallest_covering_table(keep_g: torch.Tensor) -> set[int]:
    """Brute force: among every set of blocks, the smallest that holds each block some (tile, head)
    of the group selected; it must be unique."""
    nbp = keep_g.shape[-1]
    needed = [set(torch.nonzero(row).flatten().tolist()) for row in keep_g.reshape(-1, nbp)]
    best = None
    for size in range(nbp + 1):
        found = [set(s) for s in itertools.combinations(range(nbp), size) if all(n <= set(s) for n in needed)]
        if found:
            assert len(found) == 1, found
            best = found[0]
            break
    return best


@pytest.mark.parametrize("seed", range(4))
def test_unions_are_the_smallest_tables_keeping_every_selected_block(seed):
    g_ = gen(seed)
    keep = torch.rand(3, 4, 3, 7, generator=g_) < 0.15  # [Hkv, G, T, nbp], sparse
    groups, counts = union_counts(keep)
    for h in range(3):
        assert set(torch.nonzero(groups[h]).flatten().tolist()) == smallest_covering_table(keep[h])
    heads = keep.any(dim=2)
    assert counts.tolist() == [int(keep.sum()), keep.numel(), int(heads.sum()), heads.numel(), int(groups.sum()), 21]


def _config(**kw):
    base = {"method": "compact", "sink_tokens": 0, "local_tokens": 0, "dense_below_tokens": 0, "dense_layers": []}
    return SparseConfig(**{**base, **kw})


def _batch(seq, qlens, hkv=2, g=4, d=16, n=16, seed=9):
    b = make_paged_batch(seq, hkv, n, d, seed=seed)
    layout = PageLayout.of(b.kv_cache, hkv, b.order)
    qsl = query_start_loc(qlens)
    return b, layout, qsl, randn(qsl[-1], hkv * g, d, g=gen(seed + 1))


@pytest.mark.parametrize("seq,local", [(1200, 64), (1210, 0)])
def test_row_pages_are_kept_blocks_plus_the_diagonal_block_less_forced_pages(seq, local):
    """Rows: every page of each block the group kept (the oracle's union), every past page of the
    block holding the chunk's first token (1210: ctx 1110, past page 68 in block 34), none of the
    sink/local pages (the tables add those)."""
    n, d, bp, ql = 16, 16, 2, 100
    b, layout, qsl, query, _ = _planted(seq=seq)
    cfg = _config(sink_tokens=16, local_tokens=local, compact={"block_threshold": 0.06, "block_pages": bp, "tile": 32})
    plan = plan_step(cfg.for_layer(1), n, qsl, [seq])
    req = plan.requests[0]
    ctx, forced = seq - ql, set(req.forced_past.tolist())
    sel = make_selector(cfg, d**-0.5)(query, layout.page_keys(b.kv_cache), b.block_table, layout, plan)
    nbp = ctx // (bp * n)
    tiles = oracle_tile_keep(query, b.keys[0], ctx, bp * n, nbp, d**-0.5, 0.06, 32)
    for h in range(2):
        blocks = smallest_covering_table(tiles[h])
        want = {p for blk in blocks for p in range(bp * blk, bp * blk + bp)} | set(range(nbp * bp, ctx // n))
        row = sel.indices[h, : int(sel.counts[h])].tolist()
        assert row == sorted(want - forced), (h, row, sorted(want - forced))
        assert len(row) < req.num_select // 2, "a real threshold drops pages (the test can fail)"
    assert (seq == 1210) is (68 in row)


def _run_layer(cfg, seq, qlens, query, b, layout, d):
    pk, pv = layout.page_keys(b.kv_cache), layout.page_values(b.kv_cache)
    plan = plan_step(cfg.for_layer(1), layout.page_size, query_start_loc(qlens), seq)
    sel = make_selector(cfg, d**-0.5)(query, pk, b.block_table, layout, plan)
    tables = build_page_tables(plan, sel, b.block_table, layout)
    out = torch.empty_like(query)
    reference_executor(query, pk, pv, tables, plan, d**-0.5, out)
    return plan, sel, tables, out


def test_a_past_shorter_than_a_block_keeps_its_pages_and_scores_nothing():
    """No complete past block (ctx < B): nothing to decide, every non-forced past page is the
    diagonal block's and is kept; no tile decision is counted."""
    cfg = _config(sink_tokens=16, compact={"block_threshold": 0.9, "block_pages": 8, "tile": 32})
    b, layout, qsl, query = _batch([200], [90])  # ctx 110 < 128
    plan = plan_step(cfg.for_layer(1), 16, qsl, [200])
    sel = make_selector(cfg, 0.25)(query, layout.page_keys(b.kv_cache), b.block_table, layout, plan)
    assert sel.counts.tolist() == [5, 5]  # past pages 1..5 (page 0: sink)
    assert sel.indices[:, :5].tolist() == [[1, 2, 3, 4, 5]] * 2
    assert sel.unions.tolist() == [0, 0, 0, 0, 0, 0]


def test_zero_threshold_equals_dense_in_a_mixed_batch():
    """block_threshold 0 keeps every block: through the selection path (force_sparse: even where the
    past is short) every row is dense attention's, beside a decode row (dense: compact decodes dense)
    and chunks starting inside a page and inside a block."""
    n, hkv, d = 16, 2, 16
    seq, qlens = [97, 300, 530, 70], [1, 40, 130, 7]
    cfg = _config(force_sparse=True, sink_tokens=16, compact={"block_threshold": 0.0, "block_pages": 2, "tile": 32})
    b, layout, qsl, query = _batch(seq, qlens)
    plan, sel, tables, out = _run_layer(cfg, seq, qlens, query, b, layout, d)
    assert [r.sparse for r in plan.requests] == [False, True, True, True]
    assert int(tables.counts.sum()) == hkv * sum(r.total_pages for r in plan.requests)
    for r, (s, ql) in enumerate(zip(seq, qlens)):
        want = brute_attention(query[qsl[r] : qsl[r + 1]], b.keys[r], b.values[r], s - ql, d**-0.5, page_size=n)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]].double(), want, atol=1e-5, rtol=1e-5)


def _planted(n=16, hkv=2, g=4, d=16, seq=1200, ql=100, seed=5):
    """One request whose queries align with a direction per KV head and whose keys in two past
    blocks per head point that way: those blocks dominate FlashPrefill's scores."""
    b, layout, qsl, query = _batch([seq], [ql], hkv, g, d, n, seed)
    direction = randn(hkv, d, g=gen(seed + 2))
    direction = direction / direction.norm(dim=1, keepdim=True)
    planted = {0: (3, 11), 1: (6, 20)}  # blocks of 2 pages (32 tokens)
    keys = layout.keys(b.kv_cache)
    for h, blocks in planted.items():
        for blk in blocks:
            for p in (2 * blk, 2 * blk + 1):
                keys[int(b.block_table[0, p]), h] += 8 * direction[h]
                b.keys[0][p * n : (p + 1) * n, h] += 8 * direction[h]
        query[:, h * g : (h + 1) * g] += 4 * direction[h]
    return b, layout, qsl, query, planted


def test_real_threshold_keeps_the_heavy_blocks_and_skips_the_rest():
    n, d, seq, ql = 16, 16, 1200, 100
    b, layout, qsl, query, planted = _planted()
    cfg = _config(sink_tokens=16, local_tokens=64, compact={"block_threshold": 0.06, "block_pages": 2, "tile": 32})
    plan, sel, tables, out = _run_layer(cfg, [seq], [ql], query, b, layout, d)
    req = plan.requests[0]
    visible = []
    for h, blocks in planted.items():
        row = set(sel.indices[h, : int(sel.counts[h])].tolist())
        assert {p for blk in blocks for p in (2 * blk, 2 * blk + 1)} <= row, (h, sorted(row))
        assert len(row) <= req.num_select // 4, (h, len(row), req.num_select)  # real sparsity
        visible.append(row | set(req.forced.tolist()))
    want = brute_attention(query, b.keys[0], b.values[0], seq - ql, d**-0.5, visible_pages=visible, page_size=n)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_a_batch_selects_what_each_request_selects_alone():
    n, hkv, d = 16, 2, 16
    seq, qlens = [300, 600, 1200, 450], [1, 60, 100, 33]
    cfg = _config(sink_tokens=16, local_tokens=32, compact={"block_threshold": 0.8, "block_pages": 1, "tile": 16})
    b, layout, qsl, query = _batch(seq, qlens, seed=11)
    query = query * 3
    _, together, _, _ = _run_layer(cfg, seq, qlens, query, b, layout, d)
    for r in range(1, 4):
        row_table = b.block_table[r : r + 1]
        plan = plan_step(cfg.for_layer(1), n, [0, qlens[r]], [seq[r]])
        alone = make_selector(cfg, d**-0.5)(
            query[qsl[r] : qsl[r + 1]], layout.page_keys(b.kv_cache), row_table, layout, plan
        )
        for h in range(hkv):
            k = int(alone.counts[h])
            assert int(together.counts[r * hkv + h]) == k
            assert torch.equal(together.indices[r * hkv + h, :k], alone.indices[h, :k])
    assert int(together.counts[:hkv].sum()) == 0  # the decode row selects nothing (dense)
    assert int(together.counts.sum()) < hkv * (30 + 65 + 23) * 3 // 4, "pages dropped (the test can fail)"


def test_union_counters_per_layer():
    """A selection's kept/scored past blocks per stage, added per layer (as the impl does) to the
    counters; the unions only lose sparsity."""
    stats.reset()
    b, layout, qsl, query, _ = _planted()
    cfg = _config(compact={"block_threshold": 0.06, "block_pages": 2, "tile": 32})
    plan = plan_step(cfg.for_layer(1), 16, qsl, [1200])
    sel = make_selector(cfg, 0.25)(query, layout.page_keys(b.kv_cache), b.block_table, layout, plan)
    for layer in (1, 3, 3):
        stats.record_unions(layer, sel.unions)
    snap = stats.snapshot()["block_unions"]
    stats.reset()
    assert set(snap) == {"1", "3"}
    nbp = 1100 // 32
    one = snap["1"]
    assert one["tiles"]["scored"] == 8 * 4 * nbp and one["heads"]["scored"] == 8 * nbp
    assert one["groups"]["scored"] == 2 * nbp
    assert snap["3"]["groups"]["kept"] == 2 * one["groups"]["kept"]
    s = [one[k]["sparsity"] for k in ("tiles", "heads", "groups")]
    assert 1 > s[0] >= s[1] >= s[2] > 0, s


def test_the_policy_ignores_the_budget():
    """Every non-forced past page is a candidate, whatever the budget; a covering budget does not
    send a chunk dense (the threshold decides), dense_below_tokens and dense layers still do."""
    cfg = _config(budget={"fraction": 1.0, "min_tokens": 0}, dense_below_tokens=256, dense_layers=[0],
                  sink_tokens=16, local_tokens=64)  # fmt: skip
    plan = plan_step(cfg.for_layer(1), 16, query_start_loc([40, 40, 1]), [1040, 200, 1041])
    big, short, decode = plan.requests
    assert big.sparse and big.num_select == 1000 // 16 - 1 - 4
    assert not short.sparse and not decode.sparse
    assert not plan_step(cfg.for_layer(0), 16, [0, 40], [1040]).requests[0].sparse


def test_block_pages_default_and_start_up_reasons():
    from types import SimpleNamespace

    from vllm_sparse.backend.startup import sparse_config_reasons

    opts = SparseConfig(method="compact").compact
    assert [opts.pages_per_block(n) for n in (16, 32, 48, 64, 256)] == [8, 4, 3, 2, 1]
    assert _config(compact={"block_pages": 5}).compact.pages_per_block(16) == 5

    class Model:
        model = "tiny"
        model_arch_config = SimpleNamespace(total_num_attention_heads=32)

        def get_total_num_kv_heads(self):
            return 4

        def get_total_num_hidden_layers(self):
            return 8

    def reasons(**cfg):
        engine = SimpleNamespace(cache_config=SimpleNamespace(block_size=16), speculative_config=None,
                                 additional_config={"sparse_attention": cfg}, model_config=Model())  # fmt: skip
        return "\n".join(sparse_config_reasons("compact", engine))

    assert reasons() == ""
    assert reasons(compact={"query_subgroup": 8}) == ""  # the whole group of 8 query heads
    text = reasons(sparse_decode=True, compact={"query_subgroup": 4})
    assert "sparse_decode = True" in text and "prefill chunks only" in text
    assert "compact.query_subgroup = 4" in text and "(8 query heads per KV head)" in text
    assert "prefill chunks only" in reasons(layers={"3": {"sparse_decode": True}})  # one layer asking is refused too
    assert reasons(layers={"3": {"sparse_decode": False}}) == ""


# ---------------------------------------------------------------------------------------------
# The CPU engine
# ---------------------------------------------------------------------------------------------

GEN_TOKENS = 8  # (decodes run dense: few, so that the prefill pages the threshold skips show in the counters)


# alpha 0 keeps every block, through the selection path (force_sparse) from the first past page on
ZERO_THRESHOLD = {"dense_layers": [], "dense_below_tokens": 0, "force_sparse": True, "compact": {"block_threshold": 0}}
# random weights make blocks look alike (at alpha 0.5 the unions kept 98-100% of the blocks): a high
# alpha, one-page blocks and one tile per 100-token chunk (about 90% of the blocks dropped per tile)
REAL_THRESHOLD = {"sink_tokens": 32, "local_tokens": 64, "dense_layers": [0], "dense_below_tokens": 256,
                  "compact": {"block_threshold": 0.95, "block_pages": 1, "tile": 128}}  # fmt: skip


@pytest.fixture(scope="module")
def engine_results(tiny_llama, run_engines):
    return run_method_engines(run_engines, tiny_llama, "sparse_compact", ZERO_THRESHOLD, REAL_THRESHOLD, GEN_TOKENS)


@pytest.mark.engine
def test_engine_real_threshold_skips_pages_and_completes(engine_results):
    s = check_real_completes_sparse(engine_results, GEN_TOKENS)
    assert s["attended_pages"] < 0.9 * s["dense_pages"], s  # exact on CPU (decodes dense: every page)
    # prefill rows counted from the tables too (the plan of a method with no budget attends everything)
    assert s["prefill_attended_pages"] < 0.9 * s["prefill_dense_pages"], s
    unions = s["block_unions"]
    assert set(unions) == {"1", "2", "3"}, unions  # layer 0 is dense
    for layer in unions.values():
        sparsity = [layer[k]["sparsity"] for k in ("tiles", "heads", "groups")]
        assert sparsity[0] >= sparsity[1] >= sparsity[2] > 0.3, unions


@pytest.mark.engine
def test_engine_fast_executor_gives_the_reference_executors_tokens(engine_results):
    check_fast_executor_gives_reference_tokens(engine_results)


@pytest.mark.engine
def test_engine_zero_threshold_gives_dense_tokens(engine_results):
    check_covering_gives_dense(engine_results, GEN_TOKENS)
