"""Triton page metadata writers, sync-free (no ``torch.unique``, no boolean indexing); twins:
``metadata.page_minmax.write_page_minmax`` and ``metadata.int4_shadow.write_int4_shadow``.

Quest min/max, two launches over the step's slots (one program per (token, KV head)):

1. ``atomic_max`` of each written slot's in-page offset into a per-block scratch (``-1`` filled):
   the last offset written to each touched page;
2. the program whose offset is its page's last one summarises the page from the cache's keys at
   offsets ``0 .. last`` (the same rule as the twin: a write at offset 0 resets the page, a partial
   rewrite summarises exactly what the page now holds), and codes the stored planes in INT8
   (``write_minmax_int8_row``) where the layout keeps the codes; other programs do nothing. Two programs
   may share a last offset only when a slot is written twice; they store the same values.

INT4 shadows, one launch: each (token, KV head) program quantizes its key exactly like
``quantize_int4`` (IEEE division, round half to even) and stores codes, scale and zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.layout import PageLayout, PageMeta


@triton.jit
def _last_offset_kernel(slot_ptr, last_ptr, PAGE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        tl.atomic_max(last_ptr + slot // PAGE, (slot % PAGE).to(tl.int32))


@triton.jit
def write_minmax_int8_row(kmin, kmax, dm, lo_dst, hi_dst, scale_dst, BLOCK_D: tl.constexpr):
    """Store the INT8 codes of one (page, KV head)'s planes ``kmin, kmax [BLOCK_D]`` (the values as
    stored, any float dtype; lanes outside ``dm`` ignored) at ``lo_dst``/``hi_dst`` and their scale
    at ``scale_dst``, exactly like ``metadata.minmax_int8.encode_minmax_int8`` (the same float64
    arithmetic: scale ``absmax / 127`` rounded to float32, one step up if short, codes floored
    and ceiled)."""
    lo = kmin.to(tl.float64)
    hi = kmax.to(tl.float64)
    absmax = tl.maximum(tl.max(tl.where(dm, tl.abs(lo), 0.0)), tl.max(tl.where(dm, tl.abs(hi), 0.0)))
    scale = tl.where(absmax > 0, absmax / 127.0, 1.0).to(tl.float32)
    short = scale.to(tl.float64) * 127.0 < absmax  # (a float32 scale rounded down: one step up)
    scale = tl.where(short, (scale.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), scale)
    s = scale.to(tl.float64)
    lo_c = tl.minimum(tl.maximum(tl.floor(lo / s), -127.0), 127.0)
    hi_c = tl.minimum(tl.maximum(tl.ceil(hi / s), -127.0), 127.0)
    d = tl.arange(0, BLOCK_D)
    tl.store(lo_dst + d, lo_c.to(tl.int8), mask=dm)
    tl.store(hi_dst + d, hi_c.to(tl.int8), mask=dm)
    tl.store(scale_dst, scale)


@triton.jit
def _page_minmax_kernel(
    slot_ptr,
    last_ptr,
    keys_ptr,
    kmin_ptr,
    kmax_ptr,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_mb,
    stride_mh,
    lo8_ptr,
    hi8_ptr,
    mscale_ptr,
    stride_8b,
    stride_8h,
    stride_sb,
    stride_sh,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INT8: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE
        offset = (slot % PAGE).to(tl.int32)
        last = tl.load(last_ptr + block)
        if offset == last:
            n = tl.arange(0, BLOCK_N)
            d = tl.arange(0, BLOCK_D)
            m = (n[:, None] <= offset) & (d[None, :] < D)
            ptr = keys_ptr + block * stride_kb + h * stride_kh + n[:, None] * stride_kn + d[None, :] * stride_kd
            k = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
            kmin = tl.min(tl.where(m, k, float("inf")), axis=0)
            kmax = tl.max(tl.where(m, k, float("-inf")), axis=0)
            dst = block * stride_mb + h * stride_mh + d
            kmin = kmin.to(kmin_ptr.dtype.element_ty)
            kmax = kmax.to(kmax_ptr.dtype.element_ty)
            tl.store(kmin_ptr + dst, kmin, mask=d < D)
            tl.store(kmax_ptr + dst, kmax, mask=d < D)
            if INT8:
                o8 = block * stride_8b + h * stride_8h
                write_minmax_int8_row(
                    kmin,
                    kmax,
                    d < D,
                    lo8_ptr + o8,
                    hi8_ptr + o8,
                    mscale_ptr + block * stride_sb + h * stride_sh,
                    BLOCK_D,
                )


def write_page_minmax_triton(
    layout: PageLayout, kv_cache: torch.Tensor, meta: PageMeta, slot_mapping: torch.Tensor
) -> None:
    """Same contract as ``write_page_minmax`` (call after the K/V write); any K order."""
    t = slot_mapping.shape[0]
    if t == 0:
        return
    n, d = layout.page_size, layout.head_size
    keys = layout.keys(kv_cache)  # [num_blocks, Hkv, N, D] strided view
    assert meta.kmin.stride() == meta.kmax.stride() and meta.kmin.stride(-1) == 1
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    last = torch.full((kv_cache.shape[0],), -1, dtype=torch.int32, device=kv_cache.device)
    _last_offset_kernel[(t,)](slots, last, PAGE=n)
    _page_minmax_kernel[(t, layout.num_kv_heads)](
        slots, last, keys, meta.kmin, meta.kmax, *keys.stride(), meta.kmin.stride(0), meta.kmin.stride(1),
        *int8_args(meta, meta.kmin), PAGE=n, BLOCK_N=triton.next_power_of_2(n), D=d, BLOCK_D=triton.next_power_of_2(d),
        INT8=meta.kmin8 is not None,
    )  # fmt: skip


def int8_args(meta: PageMeta | None, unused: torch.Tensor) -> tuple:
    """``(lo8, hi8, mscale, stride_8b, stride_8h, stride_sb, stride_sh)`` of the planes' INT8 codes
    (``write_minmax_int8_row``'s destinations; ``unused`` and zero strides where none are kept)."""
    if meta is None or meta.kmin8 is None:
        return (unused, unused, unused, 0, 0, 0, 0)  # (pointers never written)
    lo, hi, s = meta.kmin8, meta.kmax8, meta.mscale
    assert lo.stride() == hi.stride() and lo.stride(-1) == 1
    return (lo, hi, s, lo.stride(0), lo.stride(1), s.stride(0), s.stride(1))


@triton.jit
def _round_half_even(y):
    """``torch.round`` of non-negative float32 values (exact: ``y - floor(y)`` is exact)."""
    r = tl.floor(y)
    f = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    up = (f > 0.5) | ((f == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def write_int4_row(
    src, codes_dst, scale_dst, zero_dst, HALF_D: tl.constexpr, BLOCK_HD: tl.constexpr, CACHE_DTYPE: tl.constexpr
):
    """Quantize one key row (``2 * HALF_D`` elements at ``src``) exactly like ``quantize_int4``
    (IEEE division, round half to even) and store its codes, scale and zero."""
    j = tl.arange(0, BLOCK_HD)
    jm = j < HALF_D
    # the key as stored in the cache dtype, then float32 (like ``key.to(dtype)`` + ``.float()``)
    xe = tl.load(src + 2 * j, mask=jm, other=0.0).to(CACHE_DTYPE).to(tl.float32)
    xo = tl.load(src + 2 * j + 1, mask=jm, other=0.0).to(CACHE_DTYPE).to(tl.float32)
    lo = tl.minimum(tl.min(tl.where(jm, xe, float("inf"))), tl.min(tl.where(jm, xo, float("inf"))))
    hi = tl.maximum(tl.max(tl.where(jm, xe, float("-inf"))), tl.max(tl.where(jm, xo, float("-inf"))))
    zero = lo.to(tl.float16)
    z = zero.to(tl.float32)
    scale = tl.math.div_rn(hi - z, 15.0).to(tl.float16)
    s = scale.to(tl.float32)
    s = tl.where(s > 0, s, 1.0)
    qe = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(xe - z, s)), 0.0), 15.0)
    qo = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(xo - z, s)), 0.0), 15.0)
    byte = (qe.to(tl.int32) | (qo.to(tl.int32) << 4)).to(tl.uint8)
    tl.store(codes_dst + j, byte, mask=jm)
    tl.store(scale_dst, scale)
    tl.store(zero_dst, zero)


@triton.jit
def _int4_write_kernel(
    slot_ptr,
    key_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    stride_kt,
    stride_kh,
    stride_cb,
    stride_ch,
    stride_cn,
    stride_sb,
    stride_sh,
    PAGE: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    CACHE_DTYPE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE
        offset = slot % PAGE
        so = block * stride_sb + h * stride_sh + offset
        write_int4_row(
            key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh,
            codes_ptr + block * stride_cb + h * stride_ch + offset * stride_cn,
            scale_ptr + so,
            zero_ptr + so,
            HALF_D,
            BLOCK_HD,
            CACHE_DTYPE,
        )


TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def write_int4_shadow_triton(
    meta: PageMeta, key: torch.Tensor, slot_mapping: torch.Tensor, page_size: int, dtype: torch.dtype | None = None
) -> None:
    """Same contract as ``write_int4_shadow``; ``key [T, Hkv, D]`` last dim contiguous."""
    t = slot_mapping.shape[0]
    if t == 0:
        return
    _, hkv, n, half = meta.codes.shape
    assert key.stride(-1) == 1 and meta.codes.stride(-1) == 1 and meta.scale.stride() == meta.zero.stride()
    if not key.is_cuda and dtype is not None and key.dtype != dtype:
        key = key.to(dtype)  # Triton's interpreter truncates float32 -> bfloat16; the GPU rounds to even
    cache_dtype = TL_DTYPES[dtype or key.dtype]
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    _int4_write_kernel[(t, hkv)](
        slots,
        key,
        meta.codes,
        meta.scale,
        meta.zero,
        key.stride(0),
        key.stride(1),
        meta.codes.stride(0),
        meta.codes.stride(1),
        meta.codes.stride(2),
        meta.scale.stride(0),
        meta.scale.stride(1),
        PAGE=page_size,
        HALF_D=half,
        BLOCK_HD=triton.next_power_of_2(half),
        CACHE_DTYPE=cache_dtype,
    )
