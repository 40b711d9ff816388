"""Triton kernels (vllm_sparse/kernels) against their torch reference twins, on random inputs.

On a machine without CUDA the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set here before the kernels are defined) at small shapes; with CUDA
they run compiled on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Triton reads TRITON_INTERPRET when it is first imported (its own library functions are jitted
# then). If another module of this pytest process imported it before (vLLM does), the interpreted
# run happens in a fresh process instead (``test_in_fresh_process``).
FRESH = not HAS_CUDA and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not HAS_CUDA and not FRESH:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not installed")

from helpers import gen, randn, single_thread  # noqa: F401  (autouse fixture)

from vllm_sparse.kernels.kv_write import write_kv_triton
from vllm_sparse.kernels.quoka_query import query_mean_similarity_triton
from vllm_sparse.kernels.quoka_score import score_pages_triton
from vllm_sparse.layout import PageLayout
from vllm_sparse.metadata.writer import write_kv_reference
from vllm_sparse.selectors.quoka import group_query, score_pages

DEVICE = "cuda" if HAS_CUDA else "cpu"
in_process = pytest.mark.skipif(FRESH, reason="triton was imported before TRITON_INTERPRET=1: run in a fresh process")


@pytest.mark.skipif(not FRESH, reason="kernels run in this process")
def test_in_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(__file__)),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


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
