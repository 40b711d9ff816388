"""Twilight INT4 key shadows: asymmetric 4-bit copies of the keys, torch reference writer.

Grouping: one group per (token, KV head) over the key's D channels, i.e. every key vector has
its own ``scale`` and ``zero`` (float16), ``k ~= code * scale + zero`` with ``code`` in
``0..15``. A token is quantized once, when it is written, from the key as stored in the cache
dtype, and never depends on other tokens: pages that fill over many steps, reused blocks and
partial rewrites need no reset (stale slots past a page's fill are never read: selectors read
complete past pages only). Cost per token and KV head: D/2 bytes + 4 bytes.

On CUDA the write is the sync-free Triton kernel ``kernels.page_meta_write.write_int4_shadow_triton``
(bit-identical; the boolean indexing below would sync with the host); this torch code is its twin.
"""

from __future__ import annotations

import torch

from vllm_sparse.layout import PageMeta

LEVELS = 15  # 4 bits, asymmetric: codes 0..15


def quantize_int4(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize key vectors to packed INT4, one (scale, zero) per vector.

    Args:
        keys: ``[..., D]`` any float dtype, D even.
    Returns:
        ``codes uint8 [..., D // 2]`` (channel ``2i`` in the low nibble of byte ``i``, ``2i + 1``
        in the high nibble), ``scale float16 [...]``, ``zero float16 [...]``.
    """
    x = keys.float()
    lo, hi = x.amin(dim=-1), x.amax(dim=-1)
    zero = lo.half()
    scale = ((hi - zero.float()) / LEVELS).half()
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # constant vector: every code is 0
    q = torch.round((x - zero.float()[..., None]) / s[..., None]).clamp_(0, LEVELS).to(torch.uint8)
    codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return codes, scale, zero


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_int4``: ``codes [..., D // 2]``, ``scale/zero [...]`` -> float32 ``[..., D]``."""
    q = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).float()
    return q * scale.float()[..., None] + zero.float()[..., None]


def write_int4_shadow(
    meta: PageMeta, key: torch.Tensor, slot_mapping: torch.Tensor, page_size: int, dtype: torch.dtype | None = None
) -> None:
    """Quantize this step's keys into their slots' shadows.

    Args:
        meta: views of the cache's planes; ``codes [num_blocks, Hkv, N, D/2]``, ``scale``/``zero``
            ``[num_blocks, Hkv, N]`` are written in place.
        key: ``[T, Hkv, D]`` this step's keys (rows past ``len(slot_mapping)`` are padding).
        slot_mapping: ``int [T']`` slots ``block * N + offset``; negative = padding.
        page_size: ``N``.
        dtype: the cache dtype: keys are rounded to it first, so the shadow describes the stored key.
    """
    if key.is_cuda and key.stride(-1) == 1:
        from vllm_sparse.kernels.page_meta_write import write_int4_shadow_triton

        return write_int4_shadow_triton(meta, key, slot_mapping, page_size, dtype)
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots, key = slots[keep], key[:n][keep]
    if slots.numel() == 0:
        return
    if dtype is not None:
        key = key.to(dtype)
    codes, scale, zero = quantize_int4(key)  # [T, Hkv, D/2], [T, Hkv]
    blocks, offsets = slots // page_size, slots % page_size
    meta.codes[blocks, :, offsets] = codes
    meta.scale[blocks, :, offsets] = scale
    meta.zero[blocks, :, offsets] = zero
