"""Stage 4 (execute): the Triton paged attention executor (vllm_sparse/executors/triton_paged.py,
vllm_sparse/kernels/paged_attention.py) against its twin, the torch reference executor, on random
paged caches with variable per-row page counts (Twilight-style rows, rows with only forced pages).

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``)
at small shapes; see tests/test_kernels_triton.py for the fresh-process trick.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpret import DEVICE, HAS_CUDA, in_process, rerun_in_fresh_process

triton = pytest.importorskip("triton", reason="triton is not installed")

from helpers import brute_attention, gen, make_paged_batch, query_start_loc, randn, single_thread  # noqa: F401

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.executors.reference import reference_executor
from vllm_sparse.executors.triton_paged import TritonPagedExecutor
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors.base import Selection
from vllm_sparse.tables import build_page_tables

test_in_fresh_process = rerun_in_fresh_process(__file__)


def variable_selection(plan, hkv: int, g: torch.Generator, empty_rows=(1,)) -> tuple[Selection, dict]:
    """Distinct random non-forced past pages per row with random counts ``0 .. num_select``
    (rows listed in ``empty_rows`` select nothing: only forced pages), garbage padding."""
    rows = len(plan.requests) * hkv
    indices = torch.randint(0, 1000, (rows, plan.max_select + 2), generator=g, dtype=torch.int64)
    counts = torch.zeros(rows, dtype=torch.int32)
    chosen = {}
    for r, req in enumerate(plan.requests):
        for kh in range(hkv):
            row = r * hkv + kh
            chosen[row] = set()
            if not req.sparse:
                continue
            forced = set(req.forced.tolist())
            free = [p for p in range(req.num_past_pages) if p not in forced]
            if row in empty_rows or req.num_select == 0:
                k = 0
            else:
                k = int(torch.randint(1, req.num_select + 1, (1,), generator=g))
            pick = [free[i] for i in torch.randperm(len(free), generator=g)[:k].tolist()]
            indices[row, :k] = torch.tensor(pick, dtype=torch.int64)
            counts[row] = k
            chosen[row] = set(pick)
    return Selection(indices, counts), chosen


# (query_len, seq_len): decode rows, a chunk starting inside a page, a dense short request, and a
# long decode (many pages: several K/V tiles and splits)
REQS = [(1, 150), (21, 170), (5, 40), (1, 260)]


def run_case(group, d, dtype, num_sms, seed, reqs=REQS, hkv=2, n=16, block_n=16):
    batch = make_paged_batch([s for _, s in reqs], hkv, n, d, order="interleaved", dtype=dtype, seed=seed)
    layout = PageLayout.of(batch.kv_cache, hkv, "interleaved")
    qsl = query_start_loc([q for q, _ in reqs])
    policy = LayerPolicy(False, Budget(fraction=0.4, min_tokens=0, max_tokens=None), 16, 32, 64)
    plan = plan_step(policy, n, qsl, [s for _, s in reqs])
    g = gen(seed + 1)
    sel, chosen = variable_selection(plan, hkv, g)
    query = randn(qsl[-1], hkv * group, d, g=g, dtype=dtype)
    scale = d**-0.5
    tables = build_page_tables(plan, sel, batch.block_table, layout)
    want = torch.full_like(query, float("nan"))
    reference_executor(
        query, layout.page_keys(batch.kv_cache), layout.page_values(batch.kv_cache), tables, plan, scale, want
    )

    cache = batch.kv_cache.to(DEVICE)
    dev_tables = type(tables)(*(x.to(DEVICE) for x in (tables.page_ids, tables.counts, tables.kv_lens)))
    got = torch.full_like(query, float("nan"), device=DEVICE)
    ex = TritonPagedExecutor(block_n=block_n, num_sms=num_sms)
    ex(query.to(DEVICE), layout.page_keys(cache), layout.page_values(cache), dev_tables, plan, scale, got)
    return plan, batch, query, sel, chosen, got.cpu(), want, ex.work_plan(plan, hkv, group, torch.device(DEVICE))


@in_process
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_executor(group, d, dtype):
    plan, _, _, sel, _, got, want, work = run_case(group, d, dtype, num_sms=1, seed=group + d)
    assert work.splits == 1
    assert plan.requests[1].context_len % 16  # the chunk starts inside a page
    assert sel.counts[1] == 0 and len(set(sel.counts.tolist())) > 2  # variable counts, a forced-only row
    tol = 1e-5 if dtype == torch.float32 and not HAS_CUDA else 2e-2
    torch.testing.assert_close(got, want.to(got.dtype), rtol=tol, atol=tol)


@in_process
@pytest.mark.parametrize("group,dtype", [(1, torch.float32), (4, torch.bfloat16)])
def test_split_kv_matches_reference(group, dtype):
    plan, _, _, _, _, got, want, work = run_case(group, 64, dtype, num_sms=64, seed=5 * group)
    assert work.splits > 1
    tol = 1e-5 if dtype == torch.float32 and not HAS_CUDA else 2e-2
    torch.testing.assert_close(got, want.to(got.dtype), rtol=tol, atol=tol)


@in_process
def test_matches_brute_force_by_true_positions():
    """Independent of the tables' order: attention over the row's visible pages by position."""
    group, d, n = 2, 64, 16
    plan, batch, query, sel, chosen, got, _, _ = run_case(group, d, torch.float32, num_sms=1, seed=9)
    for r, req in enumerate(plan.requests):
        visible = [set(req.forced.tolist()) | chosen[r * 2 + kh] for kh in range(2)]
        toks = slice(req.query_start, req.query_start + req.query_len)
        want = brute_attention(query[toks], batch.keys[r], batch.values[r], req.context_len, d**-0.5, visible, n)
        t = 1e-4 if not HAS_CUDA else 2e-2  # (tf32 products on the GPU)
        torch.testing.assert_close(got[toks].double(), want, rtol=t, atol=t)


@in_process
def test_prefill_blocks_and_work_plan_cached_per_step():
    """A chunk longer than one query block (BLOCK_M 64 / G), block_n 64; the step's work plan is
    built once and reused by later layers."""
    reqs = [(40, 200), (1, 120)]
    plan, _, _, _, _, got, want, work = run_case(4, 64, torch.float32, num_sms=1, seed=3, reqs=reqs, block_n=64)
    assert work.block_m == 64 and work.num_items == 2 * (3 + 1)
    tol = 1e-5 if not HAS_CUDA else 2e-2  # (tf32 products on the GPU)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    ex = TritonPagedExecutor(block_n=64, num_sms=1)
    assert ex.work_plan(plan, 2, 4, torch.device(DEVICE)) is ex.work_plan(plan, 2, 4, torch.device(DEVICE))
    assert plan.state.triton_paged.work is work  # the step's state holds it for every layer
    assert TritonPagedExecutor(block_n=64, num_sms=8).work_plan(plan, 2, 4, torch.device(DEVICE)) is not work
