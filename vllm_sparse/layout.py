"""The in-page layout: where K, V and each metadata plane live inside one layer's paged KV cache.

vLLM hands each layer a head-major cache (``KVCacheLayout.LBHNC``)::

    kv_cache [num_blocks, num_head_slots, page_size, 2 * head_size]

The first ``num_kv_heads`` head slots hold K and V; any further slots hold page metadata
(only methods that need it ask for them, see ``backend.backends.SparseBackend.meta_slots``).
Each (block, head slot) is one contiguous region, so a (block, KV head) pair is one *page* with
the physical id ``block * num_head_slots + head``.

The metadata slots of a block are one contiguous byte region (``MetaPlanes`` below carves it into
typed planes: key min/max per page for Quest, with their INT8 codes beside them, INT4 key shadows
with per-token scale and zero point for Twilight).

Inside a K/V head slot two byte orders exist, one per platform's native kernels:

* ``planes`` (CPU, vLLM's CPU_ATTN ``vec`` packing): the slot holds K as a ``[head_size, page_size]``
  plane (transposed: channel-major), then V as a ``[page_size, head_size]`` plane. It is what
  ``cpu_attn_reshape_and_cache(..., isa="vec")`` writes and vLLM's CPU attention kernel reads.
* ``interleaved`` (GPU, FlashInfer's HND order): each token row is ``[K | V]``.

All views below are views: nothing is ever copied (K of the ``planes`` order is a transposed view).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

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
            planes = kv_cache.view(nb, self.num_head_slots, 2, n * d)
            keys = planes[:, :, 0].view(nb, self.num_head_slots, d, n).transpose(-1, -2)
            return keys, planes[:, :, 1].view(nb, self.num_head_slots, n, d)
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


# --------------------------------------------------------------------------------------------
# Metadata planes: typed views of the metadata head slots
# --------------------------------------------------------------------------------------------

_ALIGN = 16  # bytes: every plane starts 16-byte aligned inside a block's metadata region

#: The planes each method keeps (methods not listed keep none and get no extra head slots).
METHOD_PLANES: dict[str, tuple[str, ...]] = {
    "quest": ("minmax", "minmax_int8"),
    "twilight": ("minmax", "minmax_int8", "int4"),  # min/max feeds the default quest candidates
}


def _align(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class PageMeta(NamedTuple):
    """Typed views (no copies) of one layer's metadata planes, indexed by physical block.

    Attributes (``None`` where the method keeps no such plane):
        kmin, kmax: ``[num_blocks, Hkv, D]`` cache dtype; channel-wise min/max of the page's
            written keys (Quest).
        codes: ``uint8 [num_blocks, Hkv, N, D // 2]`` INT4 key shadow, channel ``2i`` in the low
            nibble and ``2i + 1`` in the high nibble of byte ``i`` (Twilight).
        scale, zero: ``float16 [num_blocks, Hkv, N]`` per token and KV head:
            ``k ~= code * scale + zero`` (asymmetric, one group = one key vector of D channels).
        kmin8, kmax8: ``int8 [num_blocks, Hkv, D]`` codes of ``kmin``/``kmax`` rounded outward,
            and ``mscale``: ``float32 [num_blocks, Hkv]`` their scale: ``kmin8 * mscale <= kmin``
            and ``kmax8 * mscale >= kmax`` (``metadata.minmax_int8``; what a decode step's Quest
            selection reads under ``quest.decode_planes: int8``). Written with ``kmin``/``kmax``.
    """

    kmin: torch.Tensor | None
    kmax: torch.Tensor | None
    codes: torch.Tensor | None
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    kmin8: torch.Tensor | None = None
    kmax8: torch.Tensor | None = None
    mscale: torch.Tensor | None = None


@dataclass(frozen=True)
class MetaPlanes:
    """Where each metadata plane lives inside a block's metadata head slots.

    Per block, the slots after the K/V heads are viewed as one byte array; planes follow each
    other, each 16-byte aligned, in this order::

        kmin  [Hkv, D] cache dtype | kmax [Hkv, D] cache dtype          (minmax)
        kmin8 [Hkv, D] int8 | kmax8 [Hkv, D] int8 | mscale [Hkv] fp32    (minmax_int8)
        codes [Hkv, N, D/2] uint8 | scale [Hkv, N] fp16 | zero [Hkv, N] fp16   (int4)

    The INT8 codes of the min/max cost no extra slot where ``Hkv * 6 * D`` bytes (bf16) fit the
    slot of ``N * 4 * D``: 8 KV heads at pages of 16 or more.
    """

    num_kv_heads: int
    page_size: int
    head_size: int
    dtype: torch.dtype
    minmax: bool
    int4: bool
    minmax_int8: bool = False

    @classmethod
    def for_method(
        cls, method: str, num_kv_heads: int, page_size: int, head_size: int, dtype: torch.dtype
    ) -> MetaPlanes | None:
        """The planes of ``method`` (``None`` when it keeps no page metadata)."""
        planes = METHOD_PLANES.get(method, ())
        if not planes:
            return None
        if "int4" in planes and head_size % 2:
            raise ValueError(f"INT4 key shadows need an even head size, got {head_size}")
        return cls(
            num_kv_heads, page_size, head_size, dtype, "minmax" in planes, "int4" in planes, "minmax_int8" in planes
        )

    def _offsets(self) -> dict[str, tuple[int, int]]:
        """Plane name -> (byte offset, byte size) inside a block's metadata region."""
        h, n, d, es = self.num_kv_heads, self.page_size, self.head_size, self.dtype.itemsize
        sizes = []
        if self.minmax:
            sizes += [("kmin", h * d * es), ("kmax", h * d * es)]
        if self.minmax_int8:
            sizes += [("kmin8", h * d), ("kmax8", h * d), ("mscale", h * 4)]
        if self.int4:
            sizes += [("codes", h * n * d // 2), ("scale", h * n * 2), ("zero", h * n * 2)]
        out, off = {}, 0
        for name, size in sizes:
            out[name] = (off, size)
            off = _align(off + size)
        return out

    @property
    def num_bytes(self) -> int:
        """Metadata bytes per block (all KV heads), planes 16-byte aligned."""
        return max((off + size for off, size in self._offsets().values()), default=0)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one head slot: ``page_size * 2 * head_size`` elements of the cache dtype."""
        return self.page_size * 2 * self.head_size * self.dtype.itemsize

    @property
    def num_slots(self) -> int:
        """Extra head slots per block that hold the planes: ``ceil(num_bytes / slot_bytes)``."""
        return -(-self.num_bytes // self.slot_bytes)

    def views(self, kv_cache: torch.Tensor) -> PageMeta:
        """Typed views of the planes of ``kv_cache [num_blocks, head_slots, N, 2D]`` (no copies)."""
        nb, slots, n, two_d = kv_cache.shape
        h, d = self.num_kv_heads, self.head_size
        if slots - h < self.num_slots or n != self.page_size or two_d != 2 * d:
            raise ValueError(
                f"cache {tuple(kv_cache.shape)} has no room for {self.num_slots} metadata slot(s) "
                f"after {h} KV heads (page {self.page_size}, head size {d})"
            )
        region = kv_cache[:, h:].flatten(1).view(torch.uint8)  # [num_blocks, meta bytes], a view
        offs = self._offsets()

        def plane(name: str, dtype: torch.dtype, *shape: int) -> torch.Tensor | None:
            if name not in offs:
                return None
            off, size = offs[name]
            return region[:, off : off + size].view(dtype).view(nb, *shape)

        return PageMeta(
            kmin=plane("kmin", self.dtype, h, d),
            kmax=plane("kmax", self.dtype, h, d),
            codes=plane("codes", torch.uint8, h, n, d // 2),
            scale=plane("scale", torch.float16, h, n),
            zero=plane("zero", torch.float16, h, n),
            kmin8=plane("kmin8", torch.int8, h, d),
            kmax8=plane("kmax8", torch.int8, h, d),
            mscale=plane("mscale", torch.float32, h),
        )
