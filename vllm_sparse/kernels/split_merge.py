"""Merging split-KV partial attention outputs by their log-sum-exp (Triton helpers of the paged and
decode attention kernels; twin: the softmax-weighted sum in ``executors.reference``).

A program that attends a share of a row's tokens stores its normalised output ``o_s`` and its
base-2 log-sum-exp ``lse_s`` (``-inf`` for an empty share); the row's output is
``sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)`` with ``m = max_s lse_s``, zeros for an empty row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_partials(part_o_ptr, part_lse_ptr, item, num_splits, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``float32 [BLOCK_M, BLOCK_D]``: the merged output of partials ``item * num_splits + s``,
    laid out ``[items, num_splits, BLOCK_M]`` (lse) and ``[..., BLOCK_D]`` (outputs)."""
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(num_splits):
        mx = tl.maximum(mx, tl.load(part_lse_ptr + (item * num_splits + s) * BLOCK_M + m))
    mx = tl.where(mx > float("-inf"), mx, 0.0)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(num_splits):
        base = (item * num_splits + s) * BLOCK_M + m
        w = tl.exp2(tl.load(part_lse_ptr + base) - mx)
        den += w
        acc += w[:, None] * tl.load(part_o_ptr + base[:, None] * BLOCK_D + d[None, :])
    return acc / tl.where(den > 0, den, 1.0)[:, None]


@triton.jit
def merge_partial_vectors(part_o_ptr, part_lse_ptr, first, stride, num_splits, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr):  # fmt: skip
    """``float32 [BLOCK_D]``: the merged output of partials ``i = first + s * stride``
    (``s < num_splits``), each a log-sum-exp ``part_lse_ptr[i]`` and an output vector
    ``part_o_ptr[i * BLOCK_D:][:BLOCK_D]``. One pass over the splits, ``BLOCK_S`` at a time with a
    running maximum, so that many splits cost few dependent loads; empty partials are not read."""
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mx = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        i = first + (s0 + s) * stride
        lse = tl.load(part_lse_ptr + i, mask=s0 + s < num_splits, other=float("-inf"))
        o = tl.load(part_o_ptr + i[:, None] * BLOCK_D + d[None, :], mask=(lse > float("-inf"))[:, None], other=0.0)
        m_new = tl.maximum(mx, tl.max(lse, 0))
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        w = tl.exp2(lse - ref)
        alpha = tl.exp2(mx - ref)
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        mx = m_new
    return acc / tl.where(den > 0, den, 1.0)
