"""sparse_compact on the GPU at Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, d 128, bf16,
pages of 16): the selector, its union counters and the page tables run under
``set_sync_debug_mode("error")`` in a mixed batch, pick what the same selector picks on the CPU, and
the Triton paged executor over its variable rows matches the reference executor."""

from __future__ import annotations

import torch
from gpu_skip import no_sync, require_cuda

require_cuda()

from test_quest_twilight_gpu import _batch  # noqa: E402

from vllm_sparse import stats  # noqa: E402
from vllm_sparse.config import SparseConfig  # noqa: E402
from vllm_sparse.executors.reference import reference_executor  # noqa: E402
from vllm_sparse.executors.triton_paged import TritonPagedExecutor  # noqa: E402
from vllm_sparse.layout import PageLayout  # noqa: E402
from vllm_sparse.policy import plan_step  # noqa: E402
from vllm_sparse.selectors import make_selector  # noqa: E402
from vllm_sparse.selectors.base import past_page_ids  # noqa: E402
from vllm_sparse.tables import build_page_tables  # noqa: E402

HKV, D, N = 8, 128, 16
REQS = [(1, 8000), (1024, 32768), (1, 3000), (512, 9000)]  # (query tokens, sequence tokens)


def _plant_even_blocks(cache, table, layout, query, block_pages):
    """Random keys make every block look alike (all kept at any threshold below ~0.9): give the keys
    of every even block, and every query, a shared direction, so that odd blocks score far lower."""
    v = torch.zeros(D, device=cache.device, dtype=cache.dtype)
    v[0] = 8.0
    pk = layout.page_keys(cache)
    for r, (_, seq) in enumerate(REQS):
        ids = past_page_ids(table, r, seq // N, layout)  # [Hkv, pages]
        even = (torch.arange(seq // N, device=cache.device) // block_pages) % 2 == 0
        pk[ids[:, even].flatten()] += v
    query += v.to(query.dtype)


def test_selection_tables_and_attention_without_sync():
    stats.reset()
    cache, table, layout, _, qsl, query = _batch(REQS, seed=0)  # (its cache also holds Twilight's planes)
    cfg = SparseConfig(method="compact", dense_layers=[], compact={"block_threshold": 0.5})
    _plant_even_blocks(cache, table, layout, query, cfg.compact.pages_per_block(N))
    seqs = [s for _, s in REQS]
    plan = plan_step(cfg.for_layer(1), N, qsl, seqs)
    assert [r.sparse for r in plan.requests] == [False, True, False, True]
    selector = make_selector(cfg, D**-0.5)
    pk, pv = layout.page_keys(cache), layout.page_values(cache)
    ex, out = TritonPagedExecutor(), torch.empty_like(query)
    warm = build_page_tables(plan, selector(query, pk, table, layout, plan), table, layout)
    ex(query, pk, pv, warm, plan, D**-0.5, out)  # warm-up: per-step caches, compilation
    torch.cuda.synchronize()
    with no_sync():
        sel = selector(query, pk, table, layout, plan)
        stats.record_unions(1, sel.unions)  # (as the impl does when the counters are on)
        tables = build_page_tables(plan, sel, table, layout)
        ex(query, pk, pv, tables, plan, D**-0.5, out)
    unions = stats.snapshot()["block_unions"]["1"]
    stats.reset()
    assert unions["groups"]["kept"] < unions["groups"]["scored"], unions
    want = torch.empty_like(query)
    reference_executor(query, pk, pv, tables, plan, D**-0.5, want)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert len(set(tables.counts.tolist())) > 2  # variable rows

    cpu_plan = plan_step(cfg.for_layer(1), N, qsl, seqs)
    cpu_layout = PageLayout.of(cache.cpu(), HKV, layout.order)
    ref = selector(query.cpu(), cpu_layout.page_keys(cache.cpu()), table.cpu(), cpu_layout, cpu_plan)
    flips = 0
    for row in range(len(REQS) * HKV):
        got_set = set(sel.indices[row, : int(sel.counts[row])].tolist())
        want_set = set(ref.indices[row, : int(ref.counts[row])].tolist())
        flips += len(got_set ^ want_set)
    assert flips <= 16, flips  # float32 sums in another order may flip a block at the threshold
