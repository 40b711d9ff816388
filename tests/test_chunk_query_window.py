"""``chunk_query_window``: prefill chunks score pages with their last W queries only, for every
selector (QuoKA, Quest, Twilight, Kascade's anchors); decode steps are unaffected."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    gen,
    make_paged_batch,
    query_start_loc,
    randn,
    single_thread,  # noqa: F401  (autouse fixture: one torch thread)
)
from pydantic import ValidationError

from vllm_sparse.config import METHODS, Budget, LayerPolicy, SparseConfig, resolve_config, shipped_configs
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.int4_shadow import write_int4_shadow
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors import QuestSelector, QuokaSelector, TwilightSelector, make_selector

N, D, HKV, G = 4, 8, 2, 3
# a long chunk, a decode request and a short chunk
REQS = [(40, 160), (1, 130), (6, 120)]


def step(seed=0):
    planes = MetaPlanes.for_method("twilight", HKV, N, D, torch.float32)  # min/max and INT4 shadows
    seq_lens = [s for _, s in REQS]
    batch = make_paged_batch(seq_lens, HKV, N, D, order="planes", meta_slots=planes.num_slots, seed=seed)
    layout = PageLayout.of(batch.kv_cache, HKV, "planes")
    meta = planes.views(batch.kv_cache)
    slots = torch.cat(
        [batch.block_table[r, torch.arange(s) // N].long() * N + torch.arange(s) % N for r, s in enumerate(seq_lens)]
    )
    write_page_minmax(layout, batch.kv_cache, meta, slots)
    write_int4_shadow(meta, torch.cat(batch.keys), slots, N, torch.float32)
    qsl = query_start_loc([ql for ql, _ in REQS])
    policy = LayerPolicy(False, Budget(fraction=0.2, min_tokens=0, max_tokens=None), 4, 8, 0, None, True)
    plan = plan_step(policy, N, qsl, seq_lens)
    assert all(r.sparse for r in plan.requests)
    query = randn(qsl[-1], HKV * G, D, g=gen(seed + 1))
    return query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta


class AnchorLayer:
    """Kascade's anchor layer 0 as one selector call: it scores the step (``observe``), then selects from
    its own anchor mass."""

    def __init__(self, window):
        cfg = SparseConfig(method="kascade", chunk_query_window=window or 0, kascade={"anchors": [0]})
        self.selector = make_selector(cfg, D**-0.5).for_layer(0, 2)

    def __call__(self, query, pk, table, layout, plan, meta=None):
        self.selector.observe(query, pk, table, layout, plan)
        return self.selector(query, pk, table, layout, plan, meta)


def selectors(window):
    return {
        "kascade": AnchorLayer(window),
        "quoka": QuokaSelector(8, query_window=window),
        "quest": QuestSelector("max", query_window=window),
        # pruned chunks: the window decides both the candidates and the top-p estimate
        "twilight": TwilightSelector(
            QuestSelector("max", query_window=window), 0.9, query_window=window, prune_prefill=True
        ),
    }


def same(a, b) -> bool:
    if not torch.equal(a.counts, b.counts):
        return False
    return all(
        set(a.indices[r, : int(a.counts[r])].tolist()) == set(b.indices[r, : int(b.counts[r])].tolist())
        for r in range(a.counts.numel())
    )


@pytest.mark.parametrize("method", ["quoka", "quest", "twilight", "kascade"])
def test_queries_before_the_window_do_not_matter(method):
    query, pk, table, layout, plan, meta = step()
    window = 5
    got = selectors(window)[method](query, pk, table, layout, plan, meta)
    changed = query.clone()
    for req in plan.requests:  # scramble every query of a chunk except its last `window`
        if req.query_len > window:
            start = req.query_start
            changed[start : start + req.query_len - window] = 20 * randn(req.query_len - window, HKV * G, D, g=gen(9))
    assert same(selectors(window)[method](changed, pk, table, layout, plan, meta), got)
    # without a window the scrambled queries do change the long chunk's pages (the test can fail)
    full = selectors(None)[method]
    assert not same(full(changed, pk, table, layout, plan, meta), full(query, pk, table, layout, plan, meta))


@pytest.mark.parametrize("method", ["quoka", "quest", "twilight", "kascade"])
def test_window_covering_every_chunk_is_no_window(method):
    query, pk, table, layout, plan, meta = step(seed=4)
    longest = max(r.query_len for r in plan.requests)
    want = selectors(None)[method](query, pk, table, layout, plan, meta)
    assert same(selectors(longest)[method](query, pk, table, layout, plan, meta), want)


def test_quest_window_scores_with_the_last_queries():
    """The long chunk's pages under window W are those its last W queries pick as a chunk alone."""
    query, pk, table, layout, plan, meta = step(seed=2)
    window = 7
    req = plan.requests[0]
    got = QuestSelector("max", query_window=window)(query, pk, table, layout, plan, meta)
    # the same request, scored by a selector that sees only the window's queries (zeros elsewhere
    # would still count in a max over raw bounds, so compare with an explicit per-query max)
    from vllm_sparse.selectors.quest import _bounds, reduce_and_pick

    blocks = table[0, : req.num_past_pages].long()
    q = query[req.query_start + req.query_len - window : req.query_start + req.query_len]
    want = reduce_and_pick(_bounds(q, meta, blocks), req.forced_past, req.num_select, "max", D**-0.5)
    for kh in range(HKV):
        assert set(got.indices[kh, : req.num_select].tolist()) == set(want[kh].tolist())


def test_config_passes_the_window_to_every_selector():
    for method in ("quoka", "quest", "twilight", "kascade"):
        s = make_selector(SparseConfig(method=method, chunk_query_window=32))
        assert s.query_window == 32
        if method == "twilight":
            assert s.base.query_window == 32
        assert make_selector(SparseConfig(method=method, chunk_query_window=0)).query_window is None  # every query
    # method defaults (DEFAULT_WINDOWS below): the selector gets the resolved window
    for method in ("quoka", "quest"):
        assert make_selector(SparseConfig(method=method)).query_window == DEFAULT_WINDOWS[method]
    tw = make_selector(SparseConfig(method="twilight"))
    assert tw.query_window == tw.base.query_window == 64
    with pytest.raises(ValidationError, match="chunk_query_window"):
        SparseConfig(chunk_query_window=-1)


# The chosen defaults (README, benchmarks/results/eval_qwen0.5b_cpu_query_window/ and
# eval_qwen1.5b_gpu_h100/window32k/): Quest and Twilight score a prefill chunk with its last 64
# queries; the others (QuoKA included: it subselects 64 of them itself) with every query (None).
DEFAULT_WINDOWS = {"quoka": None, "quest": 64, "twilight": 64, "kascade": None, "compact": None}


@pytest.mark.parametrize("method", METHODS)
def test_resolved_default_window_per_method(method):
    assert SparseConfig(method=method).query_window() == DEFAULT_WINDOWS[method]
    # every shipped config leaves the window to the method's default
    for path in shipped_configs():
        resolved = resolve_config(method, path.stem, environ={})
        assert resolved.source.startswith("shipped"), resolved.source
        assert resolved.config.query_window() == DEFAULT_WINDOWS[method], path.name
    # an explicit window still wins, 0 included
    assert SparseConfig(method=method, chunk_query_window=0).query_window() is None
    assert SparseConfig(method=method, chunk_query_window=128).query_window() == 128
