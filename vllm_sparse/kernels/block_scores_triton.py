"""The Triton kernel of FlashPrefill's tile block statistics (wrapper and torch twin:
``kernels.block_scores``).

A program takes one tile of ``TILE`` query rows of one query head and ``BLOCK_J`` blocks: the
``[TILE, BLOCK_J]`` products against the blocks' mean keys (float32), the causal rule (a row sees
a block whose last token is at or before it), then per block the max over the rows and the sum of
``exp(s - max)``, written to ``m`` and ``s`` (``[Hq, T, nb]``). Arguments that vary with the step are not specialised (one compiled variant,
warmed at engine start: ``vllm_sparse.warmup``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_queries", "num_blocks", "first_pos", "stride_qc", "stride_mh", "stride_mt"])
def block_stats_kernel(q_ptr, k_ptr, m_ptr, s_ptr, num_queries, num_blocks, first_pos, block_tokens, scale,
                       stride_qc, stride_qh, stride_qd, stride_kh, stride_kj, stride_mh, stride_mt,
                       G: tl.constexpr, TILE: tl.constexpr, BLOCK_J: tl.constexpr, D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    jb = tl.program_id(2)
    rows = t * TILE + tl.arange(0, TILE)
    dims = tl.arange(0, D)
    valid = rows < num_queries
    q_off = rows.to(tl.int64)[:, None] * stride_qc + h * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=valid[:, None], other=0.0).to(tl.float32)
    js = jb * BLOCK_J + tl.arange(0, BLOCK_J)
    k_off = (h // G) * stride_kh + js.to(tl.int64)[:, None] * stride_kj + dims[None, :]
    k = tl.load(k_ptr + k_off, mask=(js < num_blocks)[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale  # [TILE, BLOCK_J]
    sees = ((js[None, :] + 1) * block_tokens <= first_pos + rows[:, None] + 1) & valid[:, None]
    s = tl.where(sees, s, float("-inf"))
    m = tl.max(s, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.where(sees, tl.exp(s - m_safe[None, :]), 0.0)
    out = h * stride_mh + t * stride_mt + js
    tl.store(m_ptr + out, m, mask=js < num_blocks)
    tl.store(s_ptr + out, tl.sum(p, axis=0), mask=js < num_blocks)
