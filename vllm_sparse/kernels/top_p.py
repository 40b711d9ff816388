"""Triton per-row top-p of estimated page masses (Twilight's decode pruning), counts on the device;
twin: ``top_p_select_reference`` (the sort + cumulative sum of ``selectors.twilight.top_p_keep``).

Row ``r`` has ``G`` query heads and mass columns: its ``cnt[r]`` candidates first (columns
``[0, cnt)``, pages ``cand[r, :cnt]``), then the forced past pages it attends anyway (up to
``num_valid[r]``, or every column; later columns are never read). Columns hold masses or, with
``log_mass``, base-2 log-masses known up to a constant per head (``decode_page_lse_triton``),
normalised here: a first pass sums each head's candidate and forced mass (an online softmax).

Per head ``g`` the smallest set of heaviest candidates whose mass reaches ``need = top_p - forced
mass`` is exactly the candidates at or above a threshold: the largest ``t`` with
``sum(mass[key >= t]) >= need`` over the values' order-preserving int32 keys, found by bisection
(32 steps). The G heads bisect together, and the row's first ``BLOCK`` candidates (``BLOCK * G`` up
to ``REGISTER_TILE``) stay in registers across the steps: a step costs no memory access unless the
row has more (the rest is re-read, from L1/L2). A candidate is kept when any head of the group
keeps it; kept pages are written first, in column order. Each row reads its masses three times
(sums, registers, write-out) instead of 32 * G times.

One program per row, every length read on the device: the launch captures into a CUDA graph once
and replays for any lengths, and it replaces a sort, a cumulative sum, a scatter and an argsort
over ``[R, G, W]`` per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.kernels.page_topk import _key

REGISTER_TILE = 8192  # masses (G heads x candidates) a program keeps in registers
KEY_MIN = tl.constexpr(-(2**31))  # threshold below every key: keep every candidate
KEY_MAX = tl.constexpr(2**31)  # above every key: keep none


@triton.jit
def _tile(base, c, cnt, gi, gm, stride_mg, lse, LOG_MASS: tl.constexpr):
    """Keys ``int32 [BLOCK_G, BLOCK]`` and masses (0 outside the candidates) of candidate columns ``c``."""
    m = gm[:, None] & (c < cnt)[None, :]
    ptr = base + gi[:, None] * stride_mg + c[None, :]
    if LOG_MASS:
        v = tl.load(ptr, mask=m, other=float("-inf"))
        w = tl.exp2(v - lse[:, None])
    else:
        v = tl.load(ptr, mask=m, other=0.0)
        w = v
    return _key(v), w


@triton.jit(do_not_specialize=["width", "stride_mr", "stride_mg", "stride_cr", "stride_or"])
def _top_p_kernel(
    mass_ptr,
    cnt_ptr,
    valid_ptr,
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
    LOG_MASS: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    row = tl.program_id(0)
    cnt = tl.load(cnt_ptr + row)
    nv = width
    if HAS_VALID:
        nv = tl.load(valid_ptr + row)
    base = mass_ptr + row.to(tl.int64) * stride_mr
    gi = tl.arange(0, BLOCK_G)
    gm = gi < G
    # per head: candidate (lc) and forced (lf) mass; log-masses relative to a running max (mx)
    mx = tl.full([BLOCK_G], -1.0e30, tl.float32)
    lc = tl.zeros([BLOCK_G], tl.float32)
    lf = tl.zeros([BLOCK_G], tl.float32)
    for c0 in range(0, nv, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = gm[:, None] & (c < nv)[None, :]
        if LOG_MASS:
            v = tl.load(base + gi[:, None] * stride_mg + c[None, :], mask=m, other=float("-inf"))
            m_new = tl.maximum(mx, tl.max(v, axis=1))
            alpha = tl.exp2(mx - m_new)
            w = tl.exp2(v - m_new[:, None])
            mx = m_new
        else:
            alpha = 1.0
            w = tl.load(base + gi[:, None] * stride_mg + c[None, :], mask=m, other=0.0)
        is_cand = (c < cnt)[None, :]
        lc = lc * alpha + tl.sum(tl.where(is_cand, w, 0.0), axis=1)
        lf = lf * alpha + tl.sum(tl.where(is_cand, 0.0, w), axis=1)
    if LOG_MASS:
        total = tl.where(lc + lf > 0, lc + lf, 1.0)
        lse = mx + tl.log2(total)
        cand_sum = lc / total
        need = top_p - lf / total
    else:
        lse = tl.zeros([BLOCK_G], tl.float32)
        cand_sum = lc
        need = top_p - lf
    # bisection: S(t_lo) >= need > S(t_hi) = 0 for the heads that need a threshold
    t_lo = tl.full([BLOCK_G], KEY_MIN, tl.int64)
    t_hi = tl.full([BLOCK_G], KEY_MAX, tl.int64)
    if cnt > 0:
        c = tl.arange(0, BLOCK)
        key0, w0 = _tile(base, c, cnt, gi, gm, stride_mg, lse, LOG_MASS)  # stays in registers
        for _ in range(32):
            mid = (t_lo + t_hi) >> 1
            mid32 = mid.to(tl.int32)[:, None]
            above = tl.sum(tl.where(key0 >= mid32, w0, 0.0), axis=1)
            for c0 in range(BLOCK, cnt, BLOCK):
                key, w = _tile(base, c0 + c, cnt, gi, gm, stride_mg, lse, LOG_MASS)
                above += tl.sum(tl.where(key >= mid32, w, 0.0), axis=1)
            ok = above >= need
            t_lo = tl.where(ok, mid, t_lo)
            t_hi = tl.where(ok, t_hi, mid)
    thr = tl.where(cand_sum < need, KEY_MIN, t_lo)  # nothing reaches need: every candidate
    thr = tl.where((need <= 0.0) | (gi >= G), KEY_MAX, thr)  # forced pages suffice (or no such head)
    # keep = any head at or above its threshold; write kept pages first, in column order
    written = tl.zeros([], tl.int32)
    for c0 in range(0, cnt, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        cm = c < cnt
        v = tl.load(base + gi[:, None] * stride_mg + c[None, :], mask=gm[:, None] & cm[None, :], other=0.0)
        keep = tl.max((_key(v).to(tl.int64) >= thr[:, None]).to(tl.int32), axis=0) > 0
        keep = keep & cm
        k32 = keep.to(tl.int32)
        pos = written + tl.cumsum(k32, axis=0) - k32
        page = tl.load(cand_ptr + row.to(tl.int64) * stride_cr + c, mask=keep, other=0)
        tl.store(out_ptr + row.to(tl.int64) * stride_or + pos, page, mask=keep)
        written += tl.sum(k32)
    tl.store(count_ptr + row, written)


def top_p_select_triton(
    mass: torch.Tensor,
    cand_counts: torch.Tensor,
    cand: torch.Tensor,
    top_p: float,
    num_valid: torch.Tensor | None = None,
    log_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep, per row, the candidates the top-p rule keeps for any head of the group.

    Args:
        mass: ``float32 [R, G, W]`` per column (candidates first, then forced pages): estimated
            masses, each head's summing to 1 over the row's columns, or with ``log_mass`` base-2
            log-masses up to a constant per head (``exp2`` then normalised over the row's columns).
        cand_counts: ``int32 [R]`` candidates per row (``cnt``; 0: the row selects nothing).
        cand: ``int32 [R, K]`` candidate pages (``K <= W``, valid below ``cnt``).
        top_p: target mass (``>= 1``: every candidate is kept).
        num_valid: ``int32 [R]`` the row's columns (``>= cnt``); later ones are never read.
            None: all ``W`` (masses past the forced pages must then be 0, log-masses ``-inf``).
        log_mass: ``mass`` holds log-masses.
    Returns:
        ``(pages int32 [R, K], counts int32 [R])``: kept candidates first (column order); entries
        at or past ``counts`` are unspecified.
    """
    r, g, w = mass.shape
    assert mass.stride(-1) == 1 and cand.stride(-1) == 1 and cand_counts.is_contiguous()
    pages = torch.empty_like(cand)
    counts = torch.empty(r, dtype=torch.int32, device=mass.device)
    if r:
        block_g = triton.next_power_of_2(g)
        block = max(128, min(triton.next_power_of_2(cand.shape[1]), REGISTER_TILE // block_g))
        _top_p_kernel[(r,)](
            mass, cand_counts, num_valid if num_valid is not None else cand_counts, cand, pages, counts,
            float(top_p) if top_p < 1 else 3.0, w, mass.stride(0), mass.stride(1), cand.stride(0), pages.stride(0),
            G=g, BLOCK_G=block_g, BLOCK=block, LOG_MASS=log_mass, HAS_VALID=num_valid is not None,
            num_warps=8 if block * block_g >= 2048 else 4,
        )  # fmt: skip
    return pages, counts


def top_p_select_reference(
    mass: torch.Tensor,
    cand_counts: torch.Tensor,
    cand: torch.Tensor,
    top_p: float,
    num_valid: torch.Tensor | None = None,
    log_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``top_p_select_triton`` (sort + cumulative sum per head)."""
    from vllm_sparse.selectors.twilight import top_p_keep

    k = cand.shape[1]
    col = torch.arange(mass.shape[2], device=mass.device)[None, :]
    in_row = (col < (mass.shape[2] if num_valid is None else num_valid.long()[:, None]))[:, None, :]
    if log_mass:  # base 2 softmax over the row's columns
        v = mass.masked_fill(~in_row, float("-inf"))
        e = torch.exp2(v - v.amax(dim=-1, keepdim=True).clamp(min=-1e30))
        mass = e / e.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    else:
        mass = mass.masked_fill(~in_row, 0.0)
    valid = col < cand_counts[:, None]
    cand_mass = torch.where(valid[:, None, :], mass, 0.0)
    forced = mass.sum(-1) - cand_mass.sum(-1)
    keep = top_p_keep(cand_mass[..., :k], forced, top_p) & valid[:, :k]
    order = (~keep).to(torch.int8).argsort(dim=1, stable=True)
    return cand.gather(1, order), keep.sum(dim=1).to(torch.int32)
