"""FlashPrefill's per-tile block statistics (``selectors.compact``): torch twin and Triton launcher.

For scored queries ``q [C, Hq, D]`` at positions ``first_pos .. first_pos + C - 1``, cut into tiles of
``tile`` rows from the first, and block mean keys ``mean_k [Hkv, nb, D]`` (block ``j`` covers
positions ``[j * B, (j + 1) * B)``), per (query head, tile, block): ``m = max_i s_i`` and ``S = sum_i
exp(s_i - m)`` over the tile's rows ``i`` that see the whole block (``(j + 1) * B <= pos_i + 1``), with
``s_i = q_i . mean_k[j] * scale``; ``m = -inf`` and ``S = 0`` where no row sees it.

* ``tile_block_stats``: the torch twin (any device), a bounded number of tiles at a time;
* ``tile_block_stats_triton``: one program per (tile, query head, group of blocks), the products
  and both reductions in registers (``kernels.block_scores_triton``); no score tensor in memory.
"""

from __future__ import annotations

import torch

#: score elements (heads x rows x blocks) the twin computes at a time: bounds its memory
SCORE_ELEMENTS = 1 << 24


def tile_block_stats(
    q: torch.Tensor, mean_k: torch.Tensor, first_pos: int, block_tokens: int, scale: float, tile: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, S)``, each ``float32 [Hkv, G, T, nb]`` with ``T = ceil(C / tile)`` (torch twin)."""
    c, hq, d = q.shape
    hkv, nb, _ = mean_k.shape
    g, t = hq // hkv, -(-c // tile)
    m_out = torch.empty(hkv, g, t, nb, dtype=torch.float32, device=q.device)
    s_out = torch.empty_like(m_out)
    pos = first_pos + torch.arange(t * tile, device=q.device)  # padding rows: past the chunk
    ends = (torch.arange(nb, device=q.device) + 1) * block_tokens  # block j's end, exclusive
    sees = (ends[None, :] <= pos[:, None] + 1) & (torch.arange(t * tile, device=q.device) < c)[:, None]
    qg = torch.nn.functional.pad(q.float(), (0, 0, 0, 0, 0, t * tile - c))  # [T * tile, Hq, D]
    qg = qg.view(t * tile, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, T * tile, D]
    step = max(1, SCORE_ELEMENTS // max(1, hq * tile * nb))  # tiles at a time
    for a in range(0, t, step):
        b = min(a + step, t)
        rows = slice(a * tile, b * tile)
        s = torch.matmul(qg[:, :, rows], mean_k.transpose(1, 2)[:, None]) * scale  # [Hkv, G, R, nb]
        s = s.masked_fill(~sees[rows], float("-inf")).view(hkv, g, b - a, tile, nb)
        m = s.amax(dim=3)  # [Hkv, G, T', nb]
        m_out[:, :, a:b] = m
        s_out[:, :, a:b] = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0)[:, :, :, None]).sum(dim=3)
    return m_out, s_out


def triton_fits(q: torch.Tensor, tile: int) -> bool:
    """Whether ``tile_block_stats_triton`` runs these shapes: CUDA, a power-of-two head size and
    tile, both at least 16 (``tl.dot``)."""
    d = q.shape[-1]
    return q.is_cuda and tile >= 16 and d >= 16 and not tile & (tile - 1) and not d & (d - 1)


def tile_block_stats_triton(
    q: torch.Tensor, mean_k: torch.Tensor, first_pos: int, block_tokens: int, scale: float, tile: int,
    block_j: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``tile_block_stats`` in one Triton launch (same arguments and result; ``triton_fits``)."""
    import triton

    from vllm_sparse.kernels.block_scores_triton import block_stats_kernel

    c, hq, d = q.shape
    hkv, nb, _ = mean_k.shape
    t = -(-c // tile)
    m = torch.empty(hq, t, nb, dtype=torch.float32, device=q.device)
    s = torch.empty_like(m)
    mean_k = mean_k.contiguous()
    block_stats_kernel[(t, hq, triton.cdiv(nb, block_j))](
        q, mean_k, m, s, c, nb, first_pos, block_tokens, scale, q.stride(0), q.stride(1), q.stride(2),
        mean_k.stride(0), mean_k.stride(1), m.stride(0), m.stride(1),
        G=hq // hkv, TILE=tile, BLOCK_J=block_j, D=d,
    )  # fmt: skip
    return m.view(hkv, hq // hkv, t, nb), s.view(hkv, hq // hkv, t, nb)
