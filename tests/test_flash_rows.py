"""The FlashAttention rows executor's plumbing (row geometry, query gather, output scatter, page
tables as block tables, device lengths) on CPU, with FlashAttention replaced by its torch twin;
``tests/gpu/test_flash_rows_gpu.py`` runs vLLM's FlashAttention itself against the same oracle."""

from __future__ import annotations

import pytest
import torch
from helpers import gen, random_block_table, random_selection

from vllm_sparse.backend.flash_rows import FlashRowsExecutor, flash_varlen_reference
from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.executors.reference import reference_executor
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors.base import Selection, empty_selection
from vllm_sparse.tables import build_page_tables

DENSE = LayerPolicy(True, Budget(), 16, 512, 4096)
SPARSE = LayerPolicy(False, Budget(fraction=0.3, min_tokens=0, max_tokens=None), 4, 8, 0)
# (query_len, seq_len): a chunk inside a page, a one-token row, a first chunk, aligned chunks
MIXED = [(13, 97), (1, 83), (9, 9), (8, 72), (20, 152)]


def _setup(policy, hkv, group, n, d, seed, selection, vary_counts=False):
    g = gen(seed)
    seq_lens = [s for _, s in MIXED]
    qsl = [0]
    for ql, _ in MIXED:
        qsl.append(qsl[-1] + ql)
    lead = 3  # decode rows of the step before the planned requests
    qsl = [lead + x for x in qsl]
    table, num_blocks = random_block_table(seq_lens, n, g)
    cache = torch.randn(num_blocks, hkv + 1, n, 2 * d, generator=g)
    layout = PageLayout.of(cache, hkv, "interleaved")
    plan = plan_step(policy, n, qsl, seq_lens)
    sel = random_selection(plan, hkv, g)[0] if selection else empty_selection(plan, hkv, "cpu")
    if vary_counts:  # Twilight-like: rows keep fewer pages than their cap, known on the device only
        sel = Selection(sel.indices, (sel.counts - torch.arange(sel.counts.numel()) % 3).clamp(min=0).int())
    tables = build_page_tables(plan, sel, table, layout)
    query = torch.randn(qsl[-1] + 2, hkv * group, d, generator=g)  # 2 padding rows after the step
    return layout.page_keys(cache), layout.page_values(cache), plan, tables, query, lead


@pytest.mark.parametrize("group", [1, 4, 3])
@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("case", ["dense", "sparse", "varying"])
def test_rows_match_reference_executor(group, hkv, case):
    n, d, scale = 8, 16, 0.3
    policy = DENSE if case == "dense" else SPARSE
    pk, pv, plan, tables, query, lead = _setup(
        policy, hkv, group, n, d, 7 * group + hkv, case != "dense", vary_counts=case == "varying"
    )
    if case != "dense":
        assert sum(r.sparse for r in plan.requests) >= 2
    ex = FlashRowsExecutor(3, attention=flash_varlen_reference)
    got = torch.full_like(query, float("nan"))
    ex(query, pk, pv, tables, plan, scale, got)
    want = torch.full_like(query, float("nan"))
    reference_executor(query, pk, pv, tables, plan, scale, want)
    torch.testing.assert_close(got[lead:-2], want[lead:-2], rtol=1e-5, atol=1e-5)
    assert got[:lead].isnan().all() and got[-2:].isnan().all(), "rows outside the plan were written"


def test_step_geometry_is_planned_once_per_step():
    pk, pv, plan, tables, query, _ = _setup(SPARSE, 2, 4, 8, 16, 3, True)
    ex = FlashRowsExecutor(3, attention=flash_varlen_reference)
    first = ex.prepare(plan, 2, 4, 16, query.dtype, pk.dtype, 0.3, query.device)
    out = torch.empty_like(query)
    ex(query, pk, pv, tables, plan, 0.3, out)
    assert ex.prepare(plan, 2, 4, 16, query.dtype, pk.dtype, 0.3, query.device) is first is plan.state.flash_rows
    assert ex.prepare(plan, 1, 8, 16, query.dtype, pk.dtype, 0.3, query.device) is not first  # other shapes
    assert first.cu_seqlens_q.tolist()[-1] == 2 * sum(r.query_len for r in plan.requests)
    assert first.max_seqlen_k == max(r.num_pages for r in plan.requests) * 8
