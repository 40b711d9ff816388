"""The in-page layout: where K, V and each metadata plane live inside one layer's paged KV cache.

vLLM hands each layer a head-major cache (``KVCacheLayout.LBHNC``)::

    kv_cache [num_blocks, num_head_slots, page_size, 2 * head_size]

The first ``num_kv_heads`` head slots hold K and V; any further slots hold page metadata
(only methods that need it ask for them, see ``backend.backends.SparseBackend.meta_slots``).
Each (block, head slot) is one contiguous region, so a (block, KV head) pair is one *page* with
the physical id ``block * num_head_slots + head``.

Inside a K/V head slot two byte orders exist, one per platform's native kernels:

* ``planes`` (CPU, vLLM's CPU_ATTN order): the slot viewed as ``[2 * page_size, head_size]``
  holds K of all tokens, then V of all tokens.
* ``interleaved`` (GPU, FlashInfer's HND order): each token row is ``[K | V]``.

All views below are views: nothing is ever copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KVOrder = Literal["planes", "interleaved"]


@dataclass(frozen=True)
class PageLayout:
    num_kv_heads: int
    num_head_slots: int
    page_size: int
    head_size: int
    order: KVOrder

    @property
    def num_meta_slots(self) -> int:
        return self.num_head_slots - self.num_kv_heads

    @classmethod
    def of(cls, kv_cache: torch.Tensor, num_kv_heads: int, order: KVOrder) -> PageLayout:
        """Read the layout off a layer's cache ``[num_blocks, num_head_slots, page_size, 2*D]``."""
        _, slots, page, two_d = kv_cache.shape
        return cls(num_kv_heads, slots, page, two_d // 2, order)

    def _split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nb = kv_cache.shape[0]
        n, d = self.page_size, self.head_size
        if self.order == "planes":
            planes = kv_cache.view(nb, self.num_head_slots, 2 * n, d)
            return planes[:, :, :n], planes[:, :, n:]
        return kv_cache[..., :d], kv_cache[..., d:]

    def keys(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """K of every page: ``[num_blocks, num_kv_heads, page_size, head_size]`` (strided view)."""
        return self._split(kv_cache)[0][:, : self.num_kv_heads]

    def values(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """V of every page: ``[num_blocks, num_kv_heads, page_size, head_size]`` (strided view)."""
        return self._split(kv_cache)[1][:, : self.num_kv_heads]

    def page_keys(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """K indexed by physical page id: ``[num_blocks * num_head_slots, page_size, head_size]``.

        Ids of metadata slots are valid indices but hold no keys; tables never point at them.
        """
        return self._split(kv_cache)[0].flatten(0, 1)

    def page_values(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """V indexed by physical page id: ``[num_blocks * num_head_slots, page_size, head_size]``."""
        return self._split(kv_cache)[1].flatten(0, 1)

    def meta(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The metadata slots: ``[num_blocks, num_meta_slots, page_size, 2 * head_size]``."""
        return kv_cache[:, self.num_kv_heads :]

    def page_ids(self, blocks: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Physical page ids of (block, KV head) pairs; broadcasts like ``blocks * S + heads``."""
        return blocks * self.num_head_slots + heads
