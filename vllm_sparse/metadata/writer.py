"""The K/V write of ``do_kv_cache_update``: torch reference, also the CPU path for now.

Methods whose selectors read page metadata (Quest min/max, Twilight INT4 shadows) extend this
write with their planes; QuoKA keeps none.
"""

from __future__ import annotations

import torch

from vllm_sparse.layout import PageLayout


def write_kv_reference(
    layout: PageLayout,
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys and values into their slots.

    Args:
        layout: the cache's page layout.
        kv_cache: ``[num_blocks, num_head_slots, page_size, 2 * head_size]``, written in place.
        key, value: ``[T, num_kv_heads, head_size]``; only the first ``len(slot_mapping)`` rows
            are written (vLLM may pad ``key``).
        slot_mapping: ``int64 [T']`` with ``block * page_size + offset``; negative slots (padding)
            are skipped.
    """
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
    else:
        key, value = key[:n], value[:n]
    blocks = slots // layout.page_size
    offsets = slots % layout.page_size
    layout.keys(kv_cache)[blocks, :, offsets] = key.to(kv_cache.dtype)
    layout.values(kv_cache)[blocks, :, offsets] = value.to(kv_cache.dtype)
