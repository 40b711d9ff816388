"""Triton kernels vs their torch twins on the GPU at Llama-3.1-8B layer shapes, and no host sync."""

from __future__ import annotations

import pytest
import torch
from gpu_skip import require_cuda

require_cuda()

from vllm_sparse.kernels.kv_write import write_kv_triton
from vllm_sparse.kernels.quoka_score import score_pages_triton
from vllm_sparse.layout import PageLayout
from vllm_sparse.metadata import get_kv_writer
from vllm_sparse.metadata.writer import write_kv_reference
from vllm_sparse.selectors.quoka import group_query, score_pages

DEV = "cuda"


def test_cuda_writer_is_triton():
    assert get_kv_writer("cuda") is write_kv_triton


@pytest.mark.parametrize("t,meta_slots", [(1, 0), (8, 1), (2048, 1)])
def test_write_kv_llama_shapes(t, meta_slots):
    g = torch.Generator(device=DEV).manual_seed(t)
    hkv, n, d, num_blocks = 8, 16, 128, 300
    cache = torch.randn(num_blocks, hkv + meta_slots, n, 2 * d, device=DEV, generator=g).bfloat16()
    slots = torch.randperm(num_blocks * n, device=DEV, generator=g)[:t]
    if t > 4:
        slots[::7] = -1
    qkv = torch.randn(t + 3, 32 + 2 * hkv, d, device=DEV, generator=g).bfloat16()
    key, value = qkv[:, 32 : 32 + hkv], qkv[:, 32 + hkv :]  # strided, as vLLM passes them
    layout = PageLayout.of(cache, hkv, "interleaved")
    want = cache.clone()
    write_kv_reference(layout, want, key, value, slots)
    torch.cuda.set_sync_debug_mode("error")
    try:
        write_kv_triton(layout, cache, key, value, slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(cache, want)


@pytest.mark.parametrize("nq,pages", [(1, 500), (64, 1000), (37, 129)])
def test_score_pages_llama_shapes(nq, pages):
    g = torch.Generator(device=DEV).manual_seed(nq + pages)
    hkv, group, n, d, num_blocks = 8, 4, 16, 128, pages + 50
    cache = torch.randn(num_blocks, hkv, n, 2 * d, device=DEV, generator=g).bfloat16()
    layout = PageLayout.of(cache, hkv, "interleaved")
    blocks = torch.stack([torch.randperm(num_blocks, device=DEV, generator=g)[:pages] for _ in range(hkv)])
    ids = layout.page_ids(blocks, torch.arange(hkv, device=DEV)[:, None])
    qbar = group_query(torch.randn(nq, hkv * group, d, device=DEV, generator=g), hkv)
    want = score_pages(qbar, layout.page_keys(cache)[ids])
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = score_pages_triton(qbar, layout.page_keys(cache), ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)
