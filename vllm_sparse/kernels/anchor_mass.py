"""Kascade anchor scoring: the exact post-softmax attention mass of every past page, pooled.

For one request whose queries ``q [C, Hq, D]`` sit at positions ``ctx .. ctx + C - 1`` (a prefill
chunk, or ``C = 1`` for a decode token), split the queries into tiles of ``tile`` consecutive
queries (the paper's prefill Q-tile; a decode token is a tile of one). A query of tile ``t``, which
starts at position ``s_t = ctx + t * tile``, attends with softmax over every key at a position
below ``s_t``: each tile's own diagonal keys are left out (the paper's rule; they belong to the
chunk's pages, which every row attends anyway). Per KV head and tile, the weights of its
``tile x G`` (query, query head) rows are averaged (post-softmax pooling over the tile and the GQA
group), then summed over the keys of each past page (the ``ctx // N`` complete pages before the
chunk). A chunk's score of a page is the largest over its tiles: one page set per (request, KV
head) row serves the whole chunk, so a page heavy for any tile ranks high.

Three implementations, equal up to rounding:

* ``anchor_page_mass``: the torch twin (any device), tile by tile;
* ``anchor_page_mass_triton``: two Triton passes over the paged cache, read in place: pass 1 the
  log-sum-exp of every (query, head) row over its visible keys, pass 2 the pooled mass per
  (tile, KV head, past page); the max over tiles is one torch reduction;
* ``kernels.cpu_native.anchor_page_mass`` (``csrc/kascade_cpu.cpp``): one pass per (KV head, tile) on
  CPUs, keeping each page's max and sum of exponentials per row beside a running log-sum-exp, so
  that no score outlives its page.
"""

from __future__ import annotations

import torch

TILE = 32  # the default prefill tile (queries that share one pooled distribution)
MASS_STEPS = 16  # key blocks per pass-2 program (its tile's queries loaded once for all of them)


def scored_tiles(num_queries: int, tile: int, stride: int = 1) -> list[int]:
    """The tiles an anchor scores among a chunk's ``ceil(num_queries / tile)``, ascending: the last
    one and every ``stride``-th before it (``stride`` 1: all of them)."""
    tiles = -(-num_queries // tile)
    return sorted(range(tiles - 1, -1, -stride))


def anchor_page_mass(
    q: torch.Tensor,
    page_keys: torch.Tensor,
    page_ids: torch.Tensor,
    context_len: int,
    scale: float,
    tile: int = TILE,
    stride: int = 1,
) -> torch.Tensor:
    """Pooled post-softmax mass of each past page, max over the chunk's scored tiles (torch twin).

    Args:
        q: ``[C, Hq, D]`` queries at positions ``context_len .. context_len + C - 1``.
        page_keys: ``[num_pages, N, D]`` keys by physical page id (``PageLayout.page_keys``).
        page_ids: ``int64 [Hkv, P]`` physical page id of each logical page of the request,
            ``P >= ceil((context_len + C - 1) / N)`` (every page a tile's keys lie in).
        context_len: tokens before the first query.
        scale: softmax scale.
        tile: queries per tile.
        stride: score the last tile and every ``stride``-th before it (``scored_tiles``).
    Returns:
        ``float32 [Hkv, context_len // N]``: per KV head and past page, the largest over scored tiles of
        the mean over (query, query head) rows of the tile of the page's softmax weight.
    """
    c, hq, d = q.shape
    hkv = page_ids.shape[0]
    g = hq // hkv
    n = page_keys.shape[1]
    past = context_len // n
    out = torch.zeros(hkv, past, dtype=torch.float32, device=q.device)
    if past == 0:
        return out
    last = context_len + c - 1  # the last key position any tile sees is below this
    pages = -(-last // n)
    keys = page_keys[page_ids[:, :pages]].reshape(hkv, pages * n, d).float()  # [Hkv, S, D] by position
    for t in scored_tiles(c, tile, stride):
        t0 = t * tile
        qt = q[t0 : t0 + tile].float()
        m = qt.shape[0] * g
        qg = qt.view(-1, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, m, d)  # [Hkv, tile * G, D]
        visible = context_len + t0  # keys below the tile's first position
        w = torch.softmax((qg @ keys[:, :visible].transpose(1, 2)) * scale, dim=-1)  # [Hkv, M, visible]
        mass = w[:, :, : past * n].reshape(hkv, m, past, n).sum(-1).mean(1)  # [Hkv, past]
        out = torch.maximum(out, mass)
    return out


def anchor_page_mass_triton(
    q: torch.Tensor,
    page_keys: torch.Tensor,
    page_ids: torch.Tensor,
    context_len: int,
    scale: float,
    tile: int = TILE,
    stride: int = 1,
    steps: int = MASS_STEPS,
    num_warps: int = 4,
) -> torch.Tensor:
    """``anchor_page_mass`` in two Triton passes over the paged cache (same arguments and result).

    Needs a power-of-two page size ``N``; keys are read in place (any strides of ``page_keys``),
    products accumulate in float32. ``steps``: key blocks (of 64 keys) each pass-2 program walks
    with its tile's queries loaded once (1: a program per block, every block reloading them);
    ``num_warps``: of both passes' programs.
    """
    import triton

    from vllm_sparse.kernels.anchor_mass_triton import anchor_lse_kernel, anchor_mass_kernel

    c, hq, d = q.shape
    hkv = page_ids.shape[0]
    g = hq // hkv
    n = page_keys.shape[1]
    past = context_len // n
    if past == 0:
        return torch.zeros(hkv, 0, dtype=torch.float32, device=q.device)
    # a chunk shorter than a tile is one tile with fewer valid rows (TILE stays fixed); programs
    # take the scored tiles from the last one back (``scored_tiles``)
    tiles = len(scored_tiles(c, tile, stride))
    block_m = max(16, triton.next_power_of_2(tile * g))
    block_d = max(16, triton.next_power_of_2(d))
    block_p = max(1, 64 // n)  # pages per key block (64 keys)
    page_ids = page_ids.contiguous()
    lse = torch.empty(tiles, hkv, block_m, dtype=torch.float32, device=q.device)
    low = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    common = dict(G=g, D=d, N=n, TILE=tile, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_P=block_p, LOW_PRECISION=low,
                  num_warps=num_warps)  # fmt: skip
    anchor_lse_kernel[(tiles, hkv)](
        q, page_keys, page_ids, lse, c, context_len, scale, stride,
        q.stride(0), q.stride(1), page_keys.stride(0), page_keys.stride(1), page_keys.stride(2),
        page_ids.stride(0), **common,
    )  # fmt: skip
    mass = torch.empty(tiles, hkv, past, dtype=torch.float32, device=q.device)
    anchor_mass_kernel[(tiles, hkv, triton.cdiv(past, block_p * steps))](
        q, page_keys, page_ids, lse, mass, c, past, scale, stride,
        q.stride(0), q.stride(1), page_keys.stride(0), page_keys.stride(1), page_keys.stride(2),
        page_ids.stride(0), STEPS=steps, **common,
    )  # fmt: skip
    return mass.amax(dim=0)
