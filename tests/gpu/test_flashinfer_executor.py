"""FlashInfer executor vs the torch reference executor (the oracle) on the GPU.

Random caches, random block tables, bf16; dense plans and random sparse selections; mixed
batches with chunks that start inside a page, decode rows, first chunks; GQA groups 4 and 7; and
per-layer reuse of one step's plan under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_skip import require_cuda

require_cuda(flashinfer=True)

from helpers import gen, random_block_table, random_selection

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.executors import get_executor
from vllm_sparse.executors.flashinfer import FlashInferExecutor
from vllm_sparse.executors.reference import reference_executor
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors.base import empty_selection
from vllm_sparse.tables import build_page_tables

DEV = torch.device("cuda")
DENSE = LayerPolicy(True, Budget(), 16, 512, 4096)
SPARSE = LayerPolicy(False, Budget(fraction=0.3, min_tokens=0, max_tokens=None), 16, 32, 0)
# (query_len, seq_len): chunks starting inside a page, decode rows, a first chunk, page-aligned
# chunks, a chunk ending on a page boundary, a long chunk over a long context
MIXED = [(13, 297), (1, 283), (9, 9), (16, 272), (1, 530), (20, 452), (1, 1), (300, 1333)]
DECODE = [(1, 700), (1, 1025), (1, 64), (1, 2000)]


def setup(reqs, policy, hkv, group, n, d, seed, selection):
    g = gen(seed)
    seq_lens = [s for _, s in reqs]
    qsl = [0]
    for ql, _ in reqs:
        qsl.append(qsl[-1] + ql)
    table, num_blocks = random_block_table(seq_lens, n, g)
    cache = (torch.randn(num_blocks, hkv + 1, n, 2 * d, generator=g) * 2).bfloat16().to(DEV)
    layout = PageLayout.of(cache, hkv, "interleaved")
    plan = plan_step(policy, n, qsl, seq_lens)
    if selection:
        sel, _ = random_selection(plan, hkv, g)
        sel = type(sel)(sel.indices.to(DEV), sel.counts.to(DEV))
    else:
        sel = empty_selection(plan, hkv, DEV)
    tables = build_page_tables(plan, sel, table.to(DEV), layout)
    query = torch.randn(qsl[-1], hkv * group, d, generator=g).bfloat16().to(DEV)
    return cache, layout, plan, tables, query


def run_both(executor, cache, layout, plan, tables, query, scale):
    pk, pv = layout.page_keys(cache), layout.page_values(cache)
    want = torch.full_like(query, float("nan"))
    reference_executor(query, pk, pv, tables, plan, scale, want)
    got = torch.full_like(query, float("nan"))
    executor(query, pk, pv, tables, plan, scale, got)
    return got, want


def test_cuda_executor_is_flashinfer():
    assert isinstance(get_executor("cuda"), FlashInferExecutor)


@pytest.mark.parametrize("group", [4, 7])
@pytest.mark.parametrize("reqs", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("hkv", [1, 2])
def test_matches_reference(group, reqs, sparse, hkv):
    n, d = 16, 128
    scale = d**-0.5
    cache, layout, plan, tables, query = setup(
        reqs, SPARSE if sparse else DENSE, hkv, group, n, d, group * 10 + hkv + 100 * sparse, sparse
    )
    if sparse:
        assert sum(r.sparse for r in plan.requests) >= 2
    got, want = run_both(FlashInferExecutor(), cache, layout, plan, tables, query, scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("group", [4, 7])
def test_plan_reused_per_layer_without_sync(group):
    """Layer 1 plans the step; layers 2..3 (new selections, same plan) run under sync-debug 'error'."""
    hkv, n, d, scale = 2, 16, 128, 0.1
    cache, layout, plan, tables, query = setup(MIXED, SPARSE, hkv, group, n, d, 5, True)
    ex = FlashInferExecutor()
    run_both(ex, cache, layout, plan, tables, query, scale)
    planned = plan.state.flashinfer
    assert planned is not None
    for layer in range(2):
        g = gen(50 + layer)
        sel, _ = random_selection(plan, hkv, g)
        sel = type(sel)(sel.indices.to(DEV), sel.counts.to(DEV))
        table, _ = random_block_table([r.seq_len for r in plan.requests], n, g)
        table = table.remainder(cache.shape[0]).to(DEV)
        new_tables = build_page_tables(plan, sel, table, layout)
        new_query = torch.randn_like(query)
        pk, pv = layout.page_keys(cache), layout.page_values(cache)
        got = torch.full_like(query, float("nan"))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ex(new_query, pk, pv, new_tables, plan, scale, got)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = torch.empty_like(query)
        reference_executor(new_query, pk, pv, new_tables, plan, scale, want)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert len(ex._wrappers) == 1  # planned once
    assert plan.state.flashinfer is planned  # the step's one plan, reused by every layer


@pytest.mark.parametrize("reqs", [MIXED, DECODE + DECODE], ids=["mixed", "decode"])
def test_layer_forward_path_is_sync_free(reqs):
    """Selector (QuoKA: query subselection, batched decode rows), tables and executor of layers 2..4
    of a step run under sync-debug 'error' once the step is planned (as the metadata builder does)
    and layer 1 has built the step's shared tables; outputs match the reference executor."""
    from vllm_sparse.selectors.quoka import QuokaSelector

    hkv, group, n, d, scale = 2, 4, 16, 128, 0.1
    long_reqs = [(ql if ql == 1 else ql + 80, s + 900) for ql, s in reqs]  # chunks > 64 queries
    cache, layout, plan, _, query = setup(long_reqs, SPARSE, hkv, group, n, d, 77, False)
    g = gen(78)
    table, _ = random_block_table([r.seq_len for r in plan.requests], n, g)
    table = table.remainder(cache.shape[0]).to(torch.int32).to(DEV)
    ex = FlashInferExecutor()
    ex.prepare(plan, hkv, group, d, query.dtype, cache.dtype, scale, DEV)
    selector = QuokaSelector(64)
    pk, pv = layout.page_keys(cache), layout.page_values(cache)

    def layer(q):
        sel = selector(q, pk, table, layout, plan)
        tables = build_page_tables(plan, sel, table, layout)
        out = torch.full_like(q, float("nan"))
        ex(q, pk, pv, tables, plan, scale, out)
        return tables, out

    layer(query)  # layer 1 builds the step's shared state
    for i in range(3):
        q = torch.randn_like(query) + 0.1 * i
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tables, got = layer(q)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = torch.empty_like(q)
        reference_executor(q, pk, pv, tables, plan, scale, want)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert sum(r.sparse for r in plan.requests) >= 2
