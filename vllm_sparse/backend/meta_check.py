"""Debug check, off by default: page metadata equals a recompute from the keys the pages hold.

``SPARSE_ATTENTION_CHECK_META=1`` in the server's environment (read once, at import, in every vLLM
process; named beside ``SPARSE_ATTENTION_STATS``, not ``VLLM_*``, which vLLM warns about) makes
every layer of ``sparse_quest`` and ``sparse_twilight`` check, each step:

* in ``do_kv_cache_update``, after the write: every page the step wrote, over offsets
  ``0 .. last written offset`` (what the writer just summarised);
* in ``forward``, before selection: every page the step's host-planned requests can read (every
  request on CPUs, prefill chunks on GPUs), each over its filled offsets: pages read from the
  prefix cache, blocks reused from an earlier owner and pages recomputed after a preemption
  included, so a summary left stale by any of them is found where a selector would read it.

The recompute uses the writers' torch twins (``metadata.page_minmax.page_minmax``,
``metadata.int4_shadow.quantize_int4``) on the keys as stored; every plane must match bit for bit
(Quest's min/max and their INT8 codes, Twilight's INT4 codes, scale and zero of each filled slot). A mismatch is
counted and logged (``page metadata mismatch``, the layer, the blocks); the counts go to the
page counters (``stats``: ``meta_checked_pages``, ``meta_mismatched_pages``, written where
``SPARSE_ATTENTION_STATS`` points). Nothing raises, so a soak sees every mismatch of a run.

Off, it costs one boolean test per layer call. On a GPU it syncs with the host (not inside a CUDA
graph capture: steps replayed from full graphs are not checked; run with ``--enforce-eager`` to
check decodes too).
"""

from __future__ import annotations

import logging
import os

import torch

from vllm_sparse import stats
from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.metadata.int4_shadow import quantize_int4
from vllm_sparse.metadata.minmax_int8 import encode_minmax_int8
from vllm_sparse.metadata.page_minmax import page_minmax

ENV = "SPARSE_ATTENTION_CHECK_META"
ENABLED = os.environ.get(ENV, "0").strip().lower() not in ("", "0", "false", "off", "no")
MARKER = "page metadata mismatch"
_MAX_LOGGED = 20  # mismatch lines per process; the counters keep counting

logger = logging.getLogger("vllm_sparse")
_logged = 0


def page_mismatches(
    layout: PageLayout, kv_cache: torch.Tensor, meta: PageMeta, blocks: torch.Tensor, fills: torch.Tensor
) -> torch.Tensor:
    """Which pages' metadata differs from a recompute from their keys.

    Args:
        layout: the cache's page layout.
        kv_cache: ``[num_blocks, num_head_slots, N, 2D]``.
        meta: views of the cache's metadata planes.
        blocks: ``int64 [U]`` physical blocks (each block's KV heads are checked together).
        fills: ``int64 [U]`` filled offsets per block (``1 .. N``).
    Returns:
        ``bool [U]``: True where any plane of any KV head of the block differs.
    """
    keys = layout.keys(kv_cache)[blocks]  # [U, Hkv, N, D] (a gathered copy)
    bad = torch.zeros(blocks.shape[0], dtype=torch.bool, device=blocks.device)
    if meta.kmin is not None:
        kmin, kmax = page_minmax(keys, fills)
        bad |= (meta.kmin[blocks] != kmin.to(meta.kmin.dtype)).flatten(1).any(1)
        bad |= (meta.kmax[blocks] != kmax.to(meta.kmax.dtype)).flatten(1).any(1)
        if meta.kmin8 is not None:  # the INT8 codes of the planes as they should be stored
            lo, hi, scale = encode_minmax_int8(kmin.to(meta.kmin.dtype), kmax.to(meta.kmax.dtype))
            bad |= (meta.kmin8[blocks] != lo).flatten(1).any(1) | (meta.kmax8[blocks] != hi).flatten(1).any(1)
            bad |= (meta.mscale[blocks] != scale).any(1)
    if meta.codes is not None:
        codes, scale, zero = quantize_int4(keys)  # [U, Hkv, N, D/2], [U, Hkv, N]
        slot_bad = (meta.codes[blocks] != codes).any(-1) | (meta.scale[blocks] != scale) | (meta.zero[blocks] != zero)
        filled = torch.arange(layout.page_size, device=blocks.device)[None, :] < fills[:, None]  # [U, N]
        bad |= (slot_bad & filled[:, None, :]).flatten(1).any(1)
    return bad


def _report(where: str, layer_name: str, blocks: torch.Tensor, fills: torch.Tensor, bad: torch.Tensor) -> int:
    global _logged
    n_bad = int(bad.sum())
    stats.record_meta_check(int(blocks.shape[0]), n_bad)
    if n_bad and _logged < _MAX_LOGGED:
        _logged += 1
        pairs = list(zip(blocks[bad].tolist(), fills[bad].tolist()))[:8]
        logger.error("vllm-sparse: %s in %s (%s): %d of %d pages, (block, fill) %s",
                     MARKER, layer_name, where, n_bad, blocks.shape[0], pairs)  # fmt: skip
    return n_bad


def check_written(
    layer_name: str, layout: PageLayout, kv_cache: torch.Tensor, meta: PageMeta, slot_mapping: torch.Tensor
) -> int:
    """Check the pages this step wrote (call after the K/V and metadata writes); mismatches."""
    slots = slot_mapping.long()
    slots = slots[slots >= 0]
    if slots.numel() == 0:
        return 0
    n = layout.page_size
    blocks, inverse = torch.unique(slots // n, return_inverse=True)
    last = torch.zeros_like(blocks).scatter_reduce_(0, inverse, slots % n, "amax", include_self=False)
    fills = last + 1
    return _report("written pages", layer_name, blocks, fills, page_mismatches(layout, kv_cache, meta, blocks, fills))


def check_requests(
    layer_name: str,
    layout: PageLayout,
    kv_cache: torch.Tensor,
    meta: PageMeta,
    block_table: torch.Tensor,
    seq_lens: list[int],
) -> int:
    """Check every page the requests can read (block-table rows ``[R, max_blocks]``, ``seq_lens``
    context + query tokens, this step's keys already written); mismatches."""
    n = layout.page_size
    blocks, fills = [], []
    for i, s in enumerate(seq_lens):
        pages = -(-int(s) // n)
        if pages == 0:
            continue
        blocks.append(block_table[i, :pages].long())
        f = torch.full((pages,), n, dtype=torch.long)
        f[-1] = int(s) - (pages - 1) * n
        fills.append(f)
    if not blocks:
        return 0
    b = torch.cat(blocks)
    f = torch.cat(fills).to(b.device)
    return _report("pages the step reads", layer_name, b, f, page_mismatches(layout, kv_cache, meta, b, f))


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device is inside a CUDA graph capture (no host-side check possible there)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
