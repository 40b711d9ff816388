"""Triton QuoKA page scoring; twin: ``vllm_sparse.selectors.quoka.score_pages``.

A page's score is the max over the grouped queries and over the page's tokens of the cosine
between query and key. Since ``||k|| > 0`` divides every query's dot product alike,
``max_i (q_i . k) / ||k||`` is computed as one matrix product, a max over queries, then one
division per token: the keys are read once, in place, through the physical page ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _score_pages_kernel(
    q_ptr,
    keys_ptr,
    ids_ptr,
    out_ptr,
    num_queries,
    num_pages,
    stride_qh,
    stride_qn,
    stride_kp,
    stride_kt,
    stride_ih,
    stride_oh,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    h = tl.program_id(0)
    p0 = tl.program_id(1) * BLOCK_P
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qi = tl.arange(0, BLOCK_Q)
    q = tl.load(
        q_ptr + h * stride_qh + qi[:, None] * stride_qn + d[None, :],
        mask=(qi[:, None] < num_queries) & dm[None, :],
        other=0.0,
    )  # [BLOCK_Q, BLOCK_D] float32
    r = tl.arange(0, BLOCK_P * PAGE)  # token rows of BLOCK_P pages
    p = p0 + r // PAGE
    pm = p < num_pages
    page = tl.load(ids_ptr + h * stride_ih + p, mask=pm, other=0).to(tl.int64)
    k = tl.load(
        keys_ptr + page[:, None] * stride_kp + (r % PAGE)[:, None] * stride_kt + d[None, :],
        mask=pm[:, None] & dm[None, :],
        other=0.0,
    )  # [R, BLOCK_D] cache dtype
    kf = k.to(tl.float32)
    dots = tl.dot(q, tl.trans(kf))  # [BLOCK_Q, R] float32 (tf32 on the GPU)
    dots = tl.where(qi[:, None] < num_queries, dots, float("-inf"))
    best = tl.max(dots, axis=0)  # [R]
    norm = tl.maximum(tl.sqrt(tl.sum(kf * kf, axis=1)), 1e-12)
    cos = tl.reshape(best / norm, (BLOCK_P, PAGE))
    score = tl.max(cos, axis=1)  # [BLOCK_P]
    po = p0 + tl.arange(0, BLOCK_P)
    tl.store(out_ptr + h * stride_oh + po, score, mask=po < num_pages)


def score_pages_triton(qbar: torch.Tensor, page_keys: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Page scores of grouped queries against pages read in place by physical id.

    Args:
        qbar: ``float32 [Hkv, nq, D]`` grouped unit queries (``selectors.quoka.group_query``).
        page_keys: ``[num_pages_total, N, D]`` keys by physical page id (``PageLayout.page_keys``;
            a strided view, last dim contiguous).
        page_ids: ``int [Hkv, P]`` physical pages to score per KV head.
    Returns:
        ``float32 [Hkv, P]``: ``max`` over queries and the page's tokens of the cosine; equals
        ``score_pages(qbar, page_keys[page_ids])``.
    """
    hkv, nq, d = qbar.shape
    p = page_ids.shape[1]
    n = page_keys.shape[1]
    out = torch.empty(hkv, p, dtype=torch.float32, device=qbar.device)
    if p == 0:
        return out
    qbar = qbar.float().contiguous()
    assert page_keys.stride(-1) == 1 and page_ids.stride(-1) == 1
    block_q = max(16, triton.next_power_of_2(nq))
    block_p = max(1, 128 // n)
    _score_pages_kernel[(hkv, triton.cdiv(p, block_p))](
        qbar,
        page_keys,
        page_ids,
        out,
        nq,
        p,
        qbar.stride(0),
        qbar.stride(1),
        page_keys.stride(0),
        page_keys.stride(1),
        page_ids.stride(0),
        out.stride(0),
        PAGE=n,
        D=d,
        BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_P=block_p,
        num_warps=4,
    )
    return out
