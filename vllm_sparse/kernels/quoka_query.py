"""Triton QuoKA query subselection scores; twin: ``vllm_sparse.selectors.quoka.query_mean_similarity``.

For a chunk of queries ``q [C, Hq, D]`` and each head's mean query ``mean [Hq, D]``, the score of
query ``c`` of head ``h`` is ``(q[c, h] . mean[h]) / ||q[c, h]||`` (the cosine to the mean, up to
the per-head constant ``||mean[h]||``, which does not change the ranking within a head). The
queries are read once in their own dtype; nothing of size ``C x Hq x D`` is materialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens", "stride_oh"])
def _query_sim_kernel(
    q_ptr,
    mean_ptr,
    out_ptr,
    num_tokens,
    stride_qc,
    stride_qh,
    stride_oh,
    D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    h = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_D)
    cm, dm = c < num_tokens, d < D
    mean = tl.load(mean_ptr + h * D + d, mask=dm, other=0.0)  # float32 [BLOCK_D]
    q = tl.load(
        q_ptr + c[:, None] * stride_qc + h * stride_qh + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0
    ).to(tl.float32)
    dots = tl.sum(q * mean[None, :], axis=1)
    norm = tl.maximum(tl.sqrt(tl.sum(q * q, axis=1)), 1e-12)
    tl.store(out_ptr + h * stride_oh + c, dots / norm, mask=cm)


def query_mean_similarity_triton(q: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Args: q ``[C, Hq, D]`` (any float dtype, last dim contiguous); mean ``float32 [Hq, D]``.
    Returns ``float32 [Hq, C]``: ``(q . mean) / ||q||`` per head and query."""
    c, hq, d = q.shape
    out = torch.empty(hq, c, dtype=torch.float32, device=q.device)
    if c == 0:
        return out
    assert q.stride(-1) == 1
    block_d = triton.next_power_of_2(d)
    block_c = max(1, min(64, 8192 // block_d))
    _query_sim_kernel[(hq, triton.cdiv(c, block_c))](
        q,
        mean.float().contiguous(),
        out,
        c,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        D=d,
        BLOCK_C=block_c,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out
