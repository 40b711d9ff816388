"""Merging split-KV partial attention outputs by their log-sum-exp (a Triton helper of the paged and
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
