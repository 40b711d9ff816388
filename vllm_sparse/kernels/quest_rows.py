"""Quest bounds of one decode row's pages, as a Triton function that several kernels call: the
bounds kernel (``kernels.quest_score``) and the top-k kernels that score their rows' pages
themselves (``kernels.page_topk``, ``quest=``), so that a decode layer's selection is one launch.

``QuestRows`` carries the tensors and launch constants those kernels pass it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def quest_row_bounds(q_ptr, kmin_ptr, kmax_ptr, bt_ptr, out_row, req, kv, start, end, stride_qt, stride_qh,
                     stride_bt, stride_mb, stride_mh, scale_ptr, stride_sb, stride_sh, stride_og,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_P: tl.constexpr, REDUCE_MAX: tl.constexpr, LOW_PRECISION: tl.constexpr,
                     SCALED: tl.constexpr):  # fmt: skip
    """Quest bounds of decode row ``(req, kv)`` over its pages ``[start, end)``: stored at
    ``out_row + page`` (the max over the group's ``G`` query heads, ``REDUCE_MAX``) or at
    ``out_row + g * stride_og + page`` (each head). Shared by the bounds kernel and the top-k
    kernels that score a row's pages themselves (``kernels.page_topk``, ``quest=``). ``SCALED``:
    the planes hold integer codes whose page's bounds are ``scale[block, kv]`` times theirs
    (``QuestRows.scale``)."""
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(
        q_ptr + req.to(tl.int64) * stride_qt + (kv * G + g)[:, None] * stride_qh + d[None, :],
        mask=gm[:, None] & dm[None, :],
        other=0.0,
    ).to(tl.float32)
    qp = tl.maximum(q, 0.0)
    qn = tl.minimum(q, 0.0)
    if LOW_PRECISION:
        qp = qp.to(q_ptr.dtype.element_ty)
        qn = qn.to(q_ptr.dtype.element_ty)
    for p0 in range(start, end, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        pm = p < end
        blk = tl.load(bt_ptr + req.to(tl.int64) * stride_bt + p, mask=pm, other=0).to(tl.int64)
        moff = blk[:, None] * stride_mb + kv * stride_mh + d[None, :]
        mm = pm[:, None] & dm[None, :]
        kmax = tl.load(kmax_ptr + moff, mask=mm, other=0)
        kmin = tl.load(kmin_ptr + moff, mask=mm, other=0)
        if LOW_PRECISION:  # (the query's half precision; integer codes of up to 8 bits convert exactly)
            kmax = kmax.to(q_ptr.dtype.element_ty)
            kmin = kmin.to(q_ptr.dtype.element_ty)
            u = tl.dot(qp, tl.trans(kmax)) + tl.dot(qn, tl.trans(kmin))
        else:
            u = tl.dot(qp, tl.trans(kmax.to(tl.float32)), input_precision="ieee") + tl.dot(
                qn, tl.trans(kmin.to(tl.float32)), input_precision="ieee"
            )
        if SCALED:
            u = u * tl.load(scale_ptr + blk * stride_sb + kv * stride_sh, mask=pm, other=0.0).to(tl.float32)[None, :]
        if REDUCE_MAX:
            best = tl.max(tl.where(gm[:, None], u, float("-inf")), axis=0)
            tl.store(out_row + p, best, mask=pm)
        else:
            tl.store(out_row + g[:, None] * stride_og + p[None, :], u, mask=gm[:, None] & pm[None, :])


@dataclass(frozen=True)
class QuestRows:
    """What ``quest_row_bounds`` reads for the decode rows of a step.

    Attributes:
        query: ``[B, Hq, D]`` one token per decode request (last dim contiguous).
        kmin, kmax: ``[num_blocks, Hkv, D]`` the key min/max planes: in the cache dtype, or
            ``int8`` codes with ``scale``.
        block_table: ``int32 [B, max_blocks]``.
        scale: ``[num_blocks, Hkv]`` float, with ``int8`` planes: the page's min/max are at least
            as wide as ``scale * codes`` (``metadata.minmax_int8``; the layout's ``PageMeta.kmin8/kmax8/
            mscale``, read under ``quest.decode_planes: int8``. Its speed:
            ``benchmarks/bench_quest_select_gpu.py``, sessions 28-29; its cost in recall:
            ``benchmarks/minmax_precision_cpu.py``, session 28).
    """

    query: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
    block_table: torch.Tensor
    scale: torch.Tensor | None = None

    def args(self) -> tuple:
        """The pointer and stride arguments, in ``quest_row_bounds``'s order (``stride_og`` aside)."""
        q, m, s = self.query, self.kmin, self.scale
        assert q.stride(-1) == 1 and m.stride() == self.kmax.stride() and m.stride(-1) == 1
        assert self.block_table.stride(-1) == 1
        assert (s is None) == (m.dtype != torch.int8), "int8 planes come with a scale, other planes without"
        scale = (m, 0, 0) if s is None else (s, s.stride(0), s.stride(1))  # (a pointer never read)
        return (q, m, self.kmax, self.block_table, q.stride(0), q.stride(1), self.block_table.stride(0), m.stride(0),
                m.stride(1), *scale)  # fmt: skip

    def constants(self) -> dict:
        """The constexpr arguments (``G``, ``BLOCK_G``, ``D``, ``BLOCK_D``, ``LOW_PRECISION``, ``SCALED``)."""
        q, m = self.query, self.kmin
        g, d = q.shape[1] // m.shape[1], q.shape[2]
        scaled = self.scale is not None
        low = q.is_cuda and (q.dtype == m.dtype or scaled) and q.dtype in (torch.bfloat16, torch.float16)
        return dict(G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                    LOW_PRECISION=low, SCALED=scaled)  # fmt: skip
