"""Triton kernels (vllm_sparse/kernels) against their torch reference twins, on random inputs.

On a machine without CUDA the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set here before the kernels are defined) at small shapes; with CUDA
they run compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpret import DEVICE, HAS_CUDA, in_process, rerun_in_fresh_process

triton = pytest.importorskip("triton", reason="triton is not installed")

from helpers import gen, randn, single_thread  # noqa: F401  (autouse fixture)

from vllm_sparse.kernels.kv_write import write_kv_triton
from vllm_sparse.kernels.quoka_query import query_mean_similarity_triton
from vllm_sparse.kernels.quoka_score import score_pages_triton
from vllm_sparse.layout import PageLayout
from vllm_sparse.metadata.writer import write_kv_reference
from vllm_sparse.selectors.quoka import group_query, score_pages

test_in_fresh_process = rerun_in_fresh_process(__file__)


@in_process
@pytest.mark.parametrize("order,meta_slots", [("interleaved", 1), ("interleaved", 0), ("interleaved", 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size,head_size", [(4, 16), (16, 32)])
def test_write_kv_matches_reference(order, meta_slots, dtype, page_size, head_size):
    g = gen(page_size * 100 + head_size + meta_slots)
    hkv, num_blocks, t = 2, 7, 19
    cache = (randn(num_blocks, hkv + meta_slots, page_size, 2 * head_size, g=g) * 3).to(dtype)
    slots = torch.randperm(num_blocks * page_size, generator=g)[:t]
    slots[[3, 11]] = -1  # padding slots are skipped
    key = randn(t + 5, hkv, head_size, g=g, dtype=dtype)  # padded past len(slot_mapping)
    value = randn(t + 5, hkv, head_size, g=g, dtype=dtype)
    layout = PageLayout.of(cache, hkv, order)
    want = cache.clone()
    write_kv_reference(layout, want, key, value, slots)
    got = cache.to(DEVICE)
    write_kv_triton(layout, got, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(got.cpu(), want)


def test_write_kv_rejects_planes_order():
    cache = torch.zeros(2, 1, 4, 16)
    with pytest.raises(ValueError, match="interleaved"):
        write_kv_triton(PageLayout.of(cache, 1, "planes"), cache, cache[0, 0], cache[0, 0], torch.zeros(1))


@in_process
@pytest.mark.parametrize("num_queries", [1, 5, 20])
@pytest.mark.parametrize("page_size,num_pages", [(4, 37), (16, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_pages_matches_reference(num_queries, page_size, num_pages, dtype):
    g = gen(num_queries * 1000 + page_size * 10 + num_pages)
    hkv, group, d, num_blocks = 2, 3, 32, num_pages + 5
    cache = randn(num_blocks, hkv + 1, page_size, 2 * d, g=g).to(dtype)
    layout = PageLayout.of(cache, hkv, "interleaved")
    page_keys = layout.page_keys(cache)  # [num_blocks * (Hkv + 1), N, D]
    blocks = torch.stack([torch.randperm(num_blocks, generator=g)[:num_pages] for _ in range(hkv)])
    ids = layout.page_ids(blocks, torch.arange(hkv)[:, None])  # [Hkv, P]
    q = randn(num_queries, hkv * group, d, g=g)
    qbar = group_query(q, hkv)  # [Hkv, nq, D]
    want = score_pages(qbar, page_keys[ids])
    got = score_pages_triton(qbar.to(DEVICE), _on(cache, layout), ids.to(DEVICE))
    tol = 1e-5 if dtype == torch.float32 and not HAS_CUDA else 2e-2
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


def _on(cache: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """``page_keys`` of the cache moved to the test device (a strided view, as in the backend)."""
    return layout.page_keys(cache.to(DEVICE))


@in_process
def test_score_pages_ranks_like_reference():
    """Top pages agree with the twin's when scores are well separated (float32 keys)."""
    g = gen(7)
    hkv, d, n, p = 2, 32, 8, 40
    cache = randn(p + 2, hkv, n, 2 * d, g=g)
    layout = PageLayout.of(cache, hkv, "interleaved")
    ids = layout.page_ids(torch.arange(p)[None, :].expand(hkv, -1), torch.arange(hkv)[:, None])
    qbar = group_query(randn(4, hkv * 2, d, g=g), hkv)
    want = score_pages(qbar, layout.page_keys(cache)[ids]).topk(6, dim=1).indices.sort(dim=1).values
    got = score_pages_triton(qbar.to(DEVICE), _on(cache, layout), ids.to(DEVICE))
    assert torch.equal(got.cpu().topk(6, dim=1).indices.sort(dim=1).values, want)


@in_process
@pytest.mark.parametrize("chunk", [1, 37, 130])
@pytest.mark.parametrize("head_size", [64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_mean_similarity_matches_reference(chunk, head_size, dtype):
    from vllm_sparse.selectors.quoka import query_mean_similarity

    g = gen(chunk + head_size)
    hq = 3
    qkv = randn(chunk, hq + 2, head_size, g=g).to(dtype).to(DEVICE)
    q = qkv[:, :hq]  # a strided view, as vLLM's split of the fused QKV gives
    mean = q.float().mean(dim=0)
    got = query_mean_similarity_triton(q, mean)
    want = query_mean_similarity(q.cpu(), mean.cpu())
    assert got.shape == (hq, chunk)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@in_process
@pytest.mark.parametrize("hkv,meta_slots", [(1, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("short", [False, True], ids=["fixed", "variable"])
def test_fill_page_tables_matches_reference(hkv, meta_slots, short):
    from helpers import query_start_loc, random_block_table, random_selection

    from vllm_sparse.config import Budget, LayerPolicy
    from vllm_sparse.kernels.page_tables import fill_page_tables_triton
    from vllm_sparse.policy import plan_step
    from vllm_sparse.selectors.base import Selection
    from vllm_sparse.tables import _fill_torch, step_rows

    n = 4
    reqs = [(13, 97), (1, 83), (9, 9), (8, 72), (1, 130), (40, 40), (3, 250)]
    g = gen(hkv * 10 + meta_slots + short)
    seq_lens = [s for _, s in reqs]
    pol = LayerPolicy(False, Budget(fraction=0.3, min_tokens=0, max_tokens=None), 4, 8, 0)
    plan = plan_step(pol, n, query_start_loc([ql for ql, _ in reqs]), seq_lens)
    sel, _ = random_selection(plan, hkv, g)
    if short:  # top-p style: fewer valid entries than num_select, garbage after them
        counts = (sel.counts.float() * torch.rand(sel.counts.shape, generator=g)).int()
        sel = Selection(sel.indices.masked_fill(torch.arange(sel.indices.shape[1]) >= counts[:, None], 10**6), counts)
    table, _ = random_block_table(seq_lens, n, g)
    layout = PageLayout(hkv, hkv + meta_slots, n, 8, "interleaved")
    s = step_rows(plan, table.to(DEVICE), layout)
    got = fill_page_tables_triton(
        sel.indices.to(DEVICE), sel.counts.to(DEVICE), s.block_table, s.req, s.head, s.forced_ids,
        s.num_forced, s.last_len, s.width, layout.num_head_slots, n,
    )  # fmt: skip
    want = _fill_torch(s, sel.indices.to(DEVICE), sel.counts.to(DEVICE), layout)
    ids, counts, kv_lens = (t.cpu() for t in got)
    assert torch.equal(counts, want.counts.cpu()) and torch.equal(kv_lens, want.kv_lens.cpu())
    assert ids.shape == want.page_ids.shape
    for row in range(ids.shape[0]):
        c = int(counts[row])
        assert torch.equal(ids[row, :c], want.page_ids[row, :c].cpu())
        r, kh = divmod(row, hkv)
        own = {int(b) * layout.num_head_slots + kh for b in table[r, : plan.requests[r].total_pages]}
        assert set(ids[row].tolist()) <= own  # padding: pages of the row
