"""Triton K/V write into the paged cache; twin: ``vllm_sparse.metadata.writer.write_kv_reference``.

Order ``interleaved`` (GPU/FlashInfer HND: token row ``[K | V]``). One program per (token, KV head) copies one K row and one V row of ``head_size`` elements into
the token's slot. Padding slots (``slot < 0``) are skipped inside the kernel, so the write never
reads anything back to the host (no device-to-host sync, CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.layout import PageLayout


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    token_stride,
    v_offset,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE
        offset = slot % PAGE
        d = tl.arange(0, BLOCK_D)
        m = d < D
        k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=m)
        v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=m)
        dst = cache_ptr + block * stride_cb + h * stride_ch + offset * token_stride + d
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=m)
        tl.store(dst + v_offset, v.to(cache_ptr.dtype.element_ty), mask=m)


def write_kv_triton(
    layout: PageLayout,
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys and values into their slots (same contract as the reference).

    Args:
        layout: the cache's page layout; order ``interleaved`` (the GPU order) only.
        kv_cache: ``[num_blocks, num_head_slots, page_size, 2 * head_size]``, written in place;
            each (block, head slot) region must be contiguous.
        key, value: ``[T, num_kv_heads, head_size]``, last dim contiguous; only the first
            ``len(slot_mapping)`` rows are written (vLLM may pad ``key``).
        slot_mapping: ``int [T']`` with ``block * page_size + offset``; negative slots are skipped.
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return
    d, page = layout.head_size, layout.page_size
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert kv_cache.stride(3) == 1 and kv_cache.stride(2) == 2 * d
    if layout.order != "interleaved":
        raise ValueError(f"the Triton K/V writer handles the 'interleaved' order only, not {layout.order!r}")
    token_stride, v_offset = 2 * d, d  # token row = [K | V]
    _write_kv_kernel[(n, layout.num_kv_heads)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        token_stride,
        v_offset,
        PAGE=page,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
    )
