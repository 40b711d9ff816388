"""Triton per-row top-p of estimated page masses (Twilight's decode pruning), counts on the device;
twin: ``top_p_select_reference`` (the sort + cumulative sum of ``selectors.twilight.top_p_keep``).

Row ``r`` has ``G`` query heads and ``W`` mass columns: its ``cnt[r]`` candidates first (columns
``[0, cnt)``, pages ``cand[r, :cnt]``), then the forced past pages it attends anyway, then padding
(mass 0). Per head ``g`` the smallest set of heaviest candidates whose mass reaches
``need = top_p - forced mass`` is exactly the candidates with mass at or above a threshold: the
largest ``t`` with ``sum(mass >= t) >= need``, found by bisection over the masses' float bits
(masses are non-negative, so their int32 bits are ordered as they are). A candidate is kept when
any head of the group keeps it; kept pages are written first, in column order.

One program per row, every length read on the device: the launch captures into a CUDA graph once
and replays for any lengths, and it replaces a sort, a cumulative sum, a scatter and an argsort
over ``[R, G, W]`` per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
INF_BITS = tl.constexpr(0x7F800000)


@triton.jit
def _mass_at_least(row_ptr, cnt, t, BLOCK: tl.constexpr):
    """Sum of the row's candidate masses whose bits are ``>= t``."""
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, cnt, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = tl.load(row_ptr + c, mask=c < cnt, other=0.0)
        acc += tl.where(m.to(tl.int32, bitcast=True) >= t, m, 0.0)
    return tl.sum(acc)


@triton.jit(do_not_specialize=["width", "stride_mr", "stride_mg", "stride_cr", "stride_or"])
def _top_p_kernel(
    mass_ptr,
    cnt_ptr,
    cand_ptr,
    out_ptr,
    count_ptr,
    top_p,
    width,
    stride_mr,
    stride_mg,
    stride_cr,
    stride_or,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cnt = tl.load(cnt_ptr + row)
    base = mass_ptr + row.to(tl.int64) * stride_mr
    # per head: the threshold bits (INF_BITS + 1: keep nothing)
    gi = tl.arange(0, BLOCK_G)
    thr = tl.full([BLOCK_G], INF_BITS + 1, tl.int32)  # heads past G keep nothing
    for g in tl.static_range(G):
        hrow = base + g * stride_mg
        total = tl.zeros([BLOCK], tl.float32)
        cand = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, width, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            m = tl.load(hrow + c, mask=c < width, other=0.0)
            total += m
            cand += tl.where(c < cnt, m, 0.0)
        cand_sum = tl.sum(cand)
        need = top_p - (tl.sum(total) - cand_sum)
        lo = tl.zeros([], tl.int32)  # S(lo) >= need (or nothing reaches need: keep every candidate)
        hi = tl.full([], INF_BITS + 1, tl.int32)  # S(hi) = 0 < need
        if need <= 0.0:
            lo = hi
        elif cand_sum >= need:
            for _ in range(31):
                mid = lo + (hi - lo) // 2
                ok = _mass_at_least(hrow, cnt, mid, BLOCK) >= need
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
        thr = tl.where(gi == g, lo, thr)
    # keep = any head at or above its threshold; write kept pages first, in column order
    written = tl.zeros([], tl.int32)
    for c0 in range(0, cnt, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        cm = c < cnt
        m = tl.load(base + gi[:, None] * stride_mg + c[None, :], mask=(gi < G)[:, None] & cm[None, :], other=0.0)
        keep = tl.max((m.to(tl.int32, bitcast=True) >= thr[:, None]).to(tl.int32), axis=0) > 0
        keep = keep & cm
        k32 = keep.to(tl.int32)
        pos = written + tl.cumsum(k32, axis=0) - k32
        page = tl.load(cand_ptr + row.to(tl.int64) * stride_cr + c, mask=keep, other=0)
        tl.store(out_ptr + row.to(tl.int64) * stride_or + pos, page, mask=keep)
        written += tl.sum(k32)
    tl.store(count_ptr + row, written)


def top_p_select_triton(
    mass: torch.Tensor, cand_counts: torch.Tensor, cand: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep, per row, the candidates the top-p rule keeps for any head of the group.

    Args:
        mass: ``float32 [R, G, W]`` estimated mass per column (candidates first, then forced
            pages, then zeros), each head's row summing to 1 over its valid columns.
        cand_counts: ``int32 [R]`` candidates per row (``cnt``; 0: the row selects nothing).
        cand: ``int32 [R, K]`` candidate pages (``K <= W``, valid below ``cnt``).
        top_p: target mass (``>= 1``: every candidate is kept).
    Returns:
        ``(pages int32 [R, K], counts int32 [R])``: kept candidates first (column order); entries
        at or past ``counts`` are unspecified.
    """
    r, g, w = mass.shape
    assert mass.stride(-1) == 1 and cand.stride(-1) == 1
    pages = torch.zeros_like(cand)
    counts = torch.empty(r, dtype=torch.int32, device=mass.device)
    if r:
        _top_p_kernel[(r,)](
            mass, cand_counts, cand, pages, counts, float(top_p) if top_p < 1 else 3.0, w,
            mass.stride(0), mass.stride(1), cand.stride(0), pages.stride(0),
            G=g, BLOCK_G=triton.next_power_of_2(g), BLOCK=BLOCK, num_warps=4,
        )  # fmt: skip
    return pages, counts


def top_p_select_reference(
    mass: torch.Tensor, cand_counts: torch.Tensor, cand: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``top_p_select_triton`` (sort + cumulative sum per head)."""
    from vllm_sparse.selectors.twilight import top_p_keep

    k = cand.shape[1]
    valid = torch.arange(mass.shape[2], device=mass.device)[None, :] < cand_counts[:, None]
    cand_mass = torch.where(valid[:, None, :], mass, 0.0)
    forced = mass.sum(-1) - cand_mass.sum(-1)
    keep = top_p_keep(cand_mass[..., :k], forced, top_p) & valid[:, :k]
    order = (~keep).to(torch.int8).argsort(dim=1, stable=True)
    return cand.gather(1, order), keep.sum(dim=1).to(torch.int32)
