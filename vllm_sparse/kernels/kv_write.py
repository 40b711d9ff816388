"""Triton K/V write into the paged cache, and the one-launch write of a decode step (K/V plus the
page metadata the method keeps); twins: ``metadata.writer.write_kv_reference``, and for the decode
step that one followed by ``metadata.page_minmax.write_page_minmax`` and
``metadata.int4_shadow.write_int4_shadow``.

Order ``interleaved`` (GPU/FlashInfer HND: token row ``[K | V]``). One program per (token, KV
head) copies one K row and one V row of ``head_size`` elements into the token's slot. Padding
slots (``slot < 0``) are skipped inside the kernel, so the write never reads anything back to the
host (no device-to-host sync, CUDA-graph safe).

Why a decode step may fuse its metadata: each request writes one slot into its own last page, so
no two programs of a launch touch the same page. The program then also stores the INT4 shadow of
its key (Twilight) and the page's channel-wise min/max (Quest, with their INT8 codes) over the keys already in the page
(offsets ``0 .. offset - 1``, written by earlier steps) and its own key, held in registers: the
generic rule's summary (``metadata.page_minmax``), which re-reads offsets ``0 .. last written``.
The generic path needs up to five launches (K/V, a scratch fill, the last offset per page,
min/max, INT4), because a prefill chunk writes many slots of one page; per layer and decode step
that was four launches more than FLASH_ATTN's write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.kernels.page_meta_write import TL_DTYPES, int8_args, write_int4_row, write_minmax_int8_row
from vllm_sparse.kernels.pdl import launch_options, pdl_wait_then_release
from vllm_sparse.layout import PageLayout, PageMeta


@triton.jit
def _write_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    kmin_ptr,
    kmax_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_mb,
    stride_mh,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_sb,
    stride_sh,
    lo8_ptr,
    hi8_ptr,
    mscale_ptr,
    stride_8b,
    stride_8h,
    stride_ms_b,
    stride_ms_h,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MINMAX: tl.constexpr,
    INT4: tl.constexpr,
    INT8: tl.constexpr,
    CACHE_DTYPE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait_then_release(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE
        offset = (slot % PAGE).to(tl.int32)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        src_k = key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh
        k = tl.load(src_k + d, mask=dm).to(CACHE_DTYPE)
        v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=dm).to(CACHE_DTYPE)
        page = cache_ptr + block * stride_cb + h * stride_ch  # token row n: [K | V] at n * 2D
        tl.store(page + offset * (2 * D) + d, k.to(cache_ptr.dtype.element_ty), mask=dm)
        tl.store(page + offset * (2 * D) + D + d, v.to(cache_ptr.dtype.element_ty), mask=dm)
        if MINMAX:
            n = tl.arange(0, BLOCK_N)
            m = (n[:, None] < offset) & dm[None, :]
            old = tl.load(page + n[:, None] * (2 * D) + d[None, :], mask=m, other=0.0).to(tl.float32)
            kf = k.to(tl.float32)
            kmin = tl.minimum(tl.min(tl.where(m, old, float("inf")), axis=0), kf)
            kmax = tl.maximum(tl.max(tl.where(m, old, float("-inf")), axis=0), kf)
            dst = block * stride_mb + h * stride_mh + d
            kmin = kmin.to(kmin_ptr.dtype.element_ty)
            kmax = kmax.to(kmax_ptr.dtype.element_ty)
            tl.store(kmin_ptr + dst, kmin, mask=dm)
            tl.store(kmax_ptr + dst, kmax, mask=dm)
            if INT8:
                o8 = block * stride_8b + h * stride_8h
                write_minmax_int8_row(
                    kmin, kmax, dm, lo8_ptr + o8, hi8_ptr + o8, mscale_ptr + block * stride_ms_b + h * stride_ms_h,
                    BLOCK_D,
                )  # fmt: skip
        if INT4:
            so = block * stride_sb + h * stride_sh + offset
            write_int4_row(
                src_k,
                codes_ptr + block * stride_qb + h * stride_qh + offset * stride_qn,
                scale_ptr + so,
                zero_ptr + so,
                D // 2,
                BLOCK_D // 2,
                CACHE_DTYPE,
            )


def write_decode_step_triton(
    layout: PageLayout,
    kv_cache: torch.Tensor,
    meta: PageMeta | None,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write a decode step's keys and values and the pages' metadata, in one launch.

    Args:
        layout: the cache's page layout; order ``interleaved`` (the GPU order) only.
        kv_cache: ``[num_blocks, num_head_slots, N, 2D]``, written in place; each (block, head
            slot) region contiguous.
        meta: views of the cache's metadata planes (``kmin``/``kmax`` ``[num_blocks, Hkv, D]`` and
            their INT8 codes ``kmin8``/``kmax8``/``mscale``;
            ``codes`` ``uint8 [num_blocks, Hkv, N, D/2]``, ``scale``/``zero`` ``float16
            [num_blocks, Hkv, N]``), each written where present; None: K/V only.
        key, value: ``[T, Hkv, D]``, last dim contiguous; rows past ``len(slot_mapping)`` are padding.
        slot_mapping: ``int [T']`` slots ``block * N + offset``, at most one per page (one token
            per request); negative slots (CUDA-graph padding) are skipped.
    """
    t = slot_mapping.shape[0]
    if t == 0:
        return
    n, d = layout.page_size, layout.head_size
    if layout.order != "interleaved":
        raise ValueError(f"the Triton K/V writer handles the 'interleaved' order only, not {layout.order!r}")
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert kv_cache.stride(3) == 1 and kv_cache.stride(2) == 2 * d
    minmax = meta is not None and meta.kmin is not None
    int4 = meta is not None and meta.codes is not None
    int8 = minmax and meta.kmin8 is not None
    if minmax:
        assert meta.kmin.stride() == meta.kmax.stride() and meta.kmin.stride(-1) == 1
    if int4:
        assert meta.codes.stride(-1) == 1 and meta.scale.stride() == meta.zero.stride() and d % 2 == 0
    if not key.is_cuda:  # Triton's interpreter truncates float32 -> bfloat16; the GPU rounds to even
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    kmin, kmax = (meta.kmin, meta.kmax) if minmax else (kv_cache, kv_cache)  # unused when absent
    codes, scale, zero = (meta.codes, meta.scale, meta.zero) if int4 else (kv_cache, kv_cache, kv_cache)
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    _write_kernel[(t, layout.num_kv_heads)](
        key, value, kv_cache, slots, kmin, kmax, codes, scale, zero,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        kmin.stride(0) if minmax else 0, kmin.stride(1) if minmax else 0,
        codes.stride(0) if int4 else 0, codes.stride(1) if int4 else 0, codes.stride(2) if int4 else 0,
        scale.stride(0) if int4 else 0, scale.stride(1) if int4 else 0,
        *int8_args(meta if int8 else None, kv_cache),
        PAGE=n, D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_N=triton.next_power_of_2(n),
        MINMAX=minmax, INT4=int4, INT8=int8, CACHE_DTYPE=TL_DTYPES[kv_cache.dtype], **launch_options(kv_cache.device),
    )  # fmt: skip


def write_kv_triton(layout: PageLayout, kv_cache, key, value, slot_mapping) -> None:
    """Scatter this step's keys and values (``[T, Hkv, D]``) into their slots, any slots of any
    step: the contract of ``write_kv_reference``, by the decode writer's kernel with no metadata."""
    write_decode_step_triton(layout, kv_cache, None, key, value, slot_mapping)
