"""Quest page summaries: channel-wise key min and max per (page, KV head), torch reference writer.

Blocks are reused and never zeroed, and prefix-cache hits or recomputes rewrite parts of a page,
so a running min/max would mix in a previous owner's keys. Instead every page touched by this
step's write is summarised again from its own keys at offsets ``0 .. last written offset``: the
offset-0 write of a fresh page resets it, a partial rewrite (prefix-cache style, recompute of
the last token) gives the summary of exactly the tokens the page now holds, and untouched pages
(cached, full) keep theirs.

On CUDA the write is the sync-free Triton kernel ``kernels.page_meta_write.write_page_minmax_triton``
(this module's ``torch.unique`` would sync with the host), on CPUs the native op
``kernels.cpu_native.page_minmax_write`` (one call in place of some twenty small torch ops a layer);
this torch code is the twin of both.
"""

from __future__ import annotations

import torch

from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.metadata.minmax_int8 import encode_minmax_int8


def page_minmax(keys: torch.Tensor, fill: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise min and max over each page's first ``fill`` tokens.

    Args:
        keys: ``[U, Hkv, N, D]`` keys of ``U`` pages.
        fill: ``int64 [U]`` valid tokens per page (``1 .. N``).
    Returns:
        ``(kmin, kmax)``, each ``[U, Hkv, D]`` in ``keys.dtype``.
    """
    n = keys.shape[2]
    stale = torch.arange(n, device=keys.device)[None, :] >= fill[:, None]  # [U, N]
    stale = stale[:, None, :, None]
    kmin = keys.masked_fill(stale, float("inf")).amin(dim=2)
    kmax = keys.masked_fill(stale, float("-inf")).amax(dim=2)
    return kmin, kmax


def write_page_minmax(layout: PageLayout, kv_cache: torch.Tensor, meta: PageMeta, slot_mapping: torch.Tensor) -> None:
    """Recompute the summary of every page written this step (call after the K/V write).

    Args:
        layout: the cache's page layout.
        kv_cache: ``[num_blocks, num_head_slots, N, 2D]`` with this step's keys already written.
        meta: views of the cache's planes; ``meta.kmin``/``meta.kmax`` ``[num_blocks, Hkv, D]``
            are written in place, and their INT8 codes (``kmin8``/``kmax8``/``mscale``) where kept.
        slot_mapping: ``int [T]`` slots ``block * N + offset`` written this step; negative = padding.
    """
    if kv_cache.is_cuda:
        from vllm_sparse.kernels.page_meta_write import write_page_minmax_triton

        return write_page_minmax_triton(layout, kv_cache, meta, slot_mapping)
    from vllm_sparse.kernels import cpu_native

    if cpu_native.usable(kv_cache) and cpu_native.page_minmax_write(layout.keys(kv_cache), slot_mapping, meta):
        return  # one native call (csrc/page_meta_cpu.cpp), this code's twin
    slots = slot_mapping.long()
    slots = slots[slots >= 0]
    if slots.numel() == 0:
        return
    n = layout.page_size
    blocks, offsets = slots // n, slots % n
    touched, inverse = torch.unique(blocks, return_inverse=True)
    last = torch.zeros_like(touched).scatter_reduce_(0, inverse, offsets, "amax", include_self=False)
    keys = layout.keys(kv_cache)[touched]  # [U, Hkv, N, D] (a gathered copy)
    kmin, kmax = page_minmax(keys, last + 1)
    kmin, kmax = kmin.to(meta.kmin.dtype), kmax.to(meta.kmax.dtype)
    meta.kmin[touched] = kmin
    meta.kmax[touched] = kmax
    if meta.kmin8 is not None:  # the INT8 codes of the planes as stored
        lo, hi, scale = encode_minmax_int8(kmin, kmax)
        meta.kmin8[touched] = lo
        meta.kmax8[touched] = hi
        meta.mscale[touched] = scale
