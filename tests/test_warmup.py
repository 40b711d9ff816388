"""The start-up warm-up of the sparse prefill path: it runs the layer's selection and executor on
sparse synthetic chunks, and leaves the cache as it was."""

from __future__ import annotations

import pytest
import torch
from helpers import make_paged_batch, single_thread  # noqa: F401  (autouse fixture)

from vllm_sparse.config import SparseConfig
from vllm_sparse.executors import reference_executor
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.selectors import make_selector
from vllm_sparse.warmup import LONG_PAST_PAGES, warm_up_prefill, warmup_steps


@pytest.mark.parametrize("method", ["quoka", "quest", "twilight"])
def test_warm_up_runs_sparse_chunks_and_writes_no_cache(method):
    hkv, group, n, d = 2, 2, 16, 32
    planes = MetaPlanes.for_method(method, hkv, n, d, torch.float32)
    batch = make_paged_batch([700], hkv, n, d, meta_slots=planes.num_slots if planes else 0, seed=1)
    layout = PageLayout.of(batch.kv_cache, hkv, "planes")
    meta = planes.views(batch.kv_cache) if planes else None
    cfg = SparseConfig(method=method, dense_layers=[0])
    policy = cfg.for_layer(0)  # a dense layer: warmed as if sparse
    selector = make_selector(cfg, d**-0.5)
    calls, widths, seqs = [], [], []

    def counting_selector(*args):
        calls.append(args[4])
        widths.append(args[2].stride(0))
        seqs.append(args[4].requests[0].seq_len)
        return selector(*args)

    before = batch.kv_cache.clone()
    warm_up_prefill(
        counting_selector, reference_executor, policy, layout, layout.page_keys(batch.kv_cache),
        layout.page_values(batch.kv_cache), meta, hkv * group, d**-0.5, torch.float32, 256,
    )  # fmt: skip
    assert torch.equal(batch.kv_cache, before)
    steps = warmup_steps(256 * n, n)  # each twice: the layer's budget, then half of the past (nothing forced)
    assert len(calls) == 2 * len(steps) and all(p.any_sparse for p in calls)
    assert widths == [256] * 2 * len(steps), "block tables must have the engine's row stride"
    assert max(seqs) <= 256 * n, "a context past the engine's block table would compile other variants"


def test_warmup_steps_cover_the_launchers_tile_choices_within_the_context():
    steps = warmup_steps(None)
    chunks = {c for c, _ in steps}
    pasts = {s - c for c, s in steps}
    # query tiles: up to 16 scoring rows (3 queries x a group of 4), 17-64 (QuoKA's 33 grouped queries), more
    assert min(chunks) * 4 <= 16 and any(16 < c <= 64 for c in chunks) and max(chunks) > 64
    assert min(pasts) // 16 <= 32 < max(pasts) // 16, "page tiles: up to 32 past pages and more"
    assert any(p // 16 > 1024 for p in pasts), "Quest's wide page tiles: more than 1024 past pages"
    for c in chunks:  # every query tile meets every page tile
        assert {p // 16 > 1024 for p in pasts if (c, p + c) in steps} == {False, True}
    assert max(s - c for c, s in warmup_steps(None, 32)) >= LONG_PAST_PAGES * 32  # in pages of the engine
    short = warmup_steps(4096)  # the engine of the GPU e2e test: contexts clamped, none widened
    assert all(s <= 4096 for _, s in short) and {c for c, _ in short} == chunks
    assert all(s <= 400 for _, s in warmup_steps(400)) and warmup_steps(400)



def test_warm_up_scores_every_tile_whatever_the_forced_pages_leave(monkeypatch):
    """A budget that the sink and local pages fill at a short past (25% of 233 tokens against 32 + 64
    forced) selects nothing there; the warm-up's second pass (half of the past, nothing forced) still
    scores such a short past, so Quest's page-tile variant for up to 32 pages is compiled at start
    (it compiled during the first requests at tensor parallelism 2 before: one KV head per worker)."""
    import vllm_sparse.selectors.quest as quest

    hkv, group, n, d = 1, 4, 16, 32
    planes = MetaPlanes.for_method("quest", hkv, n, d, torch.float32)
    batch = make_paged_batch([700], hkv, n, d, meta_slots=planes.num_slots, seed=2)
    layout = PageLayout.of(batch.kv_cache, hkv, "planes")
    cfg = SparseConfig(method="quest", budget={"fraction": 0.25, "min_tokens": 64, "max_tokens": None},
                       sink_tokens=32, local_tokens=64, dense_below_tokens=256,
                       quest={"prefill_scores": "bounds"})  # fmt: skip
    scored, bounds = [], quest._bounds

    def counting_bounds(q, meta, blocks):
        scored.append((q.shape[0] > 16, blocks.shape[-1] > 32))  # the launcher's query and page tiles
        return bounds(q, meta, blocks)

    monkeypatch.setattr(quest, "_bounds", counting_bounds)
    warm_up_prefill(
        make_selector(cfg, d**-0.5), reference_executor, cfg.for_layer(1), layout, layout.page_keys(batch.kv_cache),
        layout.page_values(batch.kv_cache), planes.views(batch.kv_cache), hkv * group, d**-0.5, torch.float32, 256,
    )  # fmt: skip
    assert set(scored) == {(q, p) for q in (False, True) for p in (False, True)}, scored


def test_warm_up_scores_quokas_query_tiles_for_quests_exact_prefill(monkeypatch):
    """Under ``quest.prefill_scores: exact`` Quest's chunks rank pages with QuoKA's scoring: the
    warm-up runs both of its query tiles (up to 16 grouped queries, and more), so neither compiles
    in a first request."""
    import vllm_sparse.selectors.quoka as quoka

    hkv, group, n, d = 1, 4, 16, 32
    planes = MetaPlanes.for_method("quest", hkv, n, d, torch.float32)
    batch = make_paged_batch([700], hkv, n, d, meta_slots=planes.num_slots, seed=2)
    layout = PageLayout.of(batch.kv_cache, hkv, "planes")
    cfg = SparseConfig(method="quest", budget={"fraction": 0.25, "min_tokens": 64, "max_tokens": None},
                       sink_tokens=32, local_tokens=64, dense_below_tokens=256)  # fmt: skip
    assert cfg.quest_prefill_scores() == "exact"
    tiles, top_pages = [], quoka._top_pages

    def counting_top_pages(qbar, page_keys, ids, excluded, k):
        tiles.append(qbar.shape[1] > 16)  # the scoring kernel's query tile
        return top_pages(qbar, page_keys, ids, excluded, k)

    monkeypatch.setattr(quoka, "_top_pages", counting_top_pages)
    warm_up_prefill(
        make_selector(cfg, d**-0.5), reference_executor, cfg.for_layer(1), layout, layout.page_keys(batch.kv_cache),
        layout.page_values(batch.kv_cache), planes.views(batch.kv_cache), hkv * group, d**-0.5, torch.float32, 256,
    )  # fmt: skip
    assert set(tiles) == {False, True}, tiles
