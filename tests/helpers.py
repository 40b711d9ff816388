"""Shared helpers of the pipeline-stage unit tests: random paged caches and brute-force oracles.

The oracles here are written independently of ``vllm_sparse`` (only its ``Selection`` container is
used): the cache is addressed by raw index arithmetic on the
``[num_blocks, num_head_slots, page_size, 2 * head_size]`` tensor, so a test that reads it back
through ``vllm_sparse.layout.PageLayout`` checks the layout rather than itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from vllm_sparse.selectors.base import Selection


@pytest.fixture(autouse=True)
def single_thread():
    """These tests run many tiny ops: one intra-op thread is faster, above all on a busy machine.

    Autouse in every module that imports it; the previous thread count is restored afterwards.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, g: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


# --------------------------------------------------------------------------------------------
# Raw (layout-independent) addressing of one token's K and V inside the cache
# --------------------------------------------------------------------------------------------


def raw_kv_index(order: str, page_size: int, head_size: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of K and V (``[head_size]`` each) of in-page ``offset`` into ``slot.reshape(-1)``,
    where ``slot`` is one (block, head slot) region of ``page_size * 2 * head_size`` elements."""
    n, d = page_size, head_size
    ch = torch.arange(d)
    if order == "planes":  # slot = K plane [D, N] (channel-major), then V plane [N, D]
        return ch * n + offset, n * d + offset * d + ch
    if order == "interleaved":  # slot = [N, 2D]: row = [K | V]
        return offset * 2 * d + ch, offset * 2 * d + d + ch
    raise ValueError(order)


def raw_write(kv_cache: torch.Tensor, order: str, block: int, head: int, offset: int, k, v) -> None:
    n, d = kv_cache.shape[2], kv_cache.shape[3] // 2
    flat = kv_cache[block, head].reshape(-1)
    assert flat.data_ptr() == kv_cache[block, head].data_ptr()  # contiguous region: reshape is a view
    ki, vi = raw_kv_index(order, n, d, offset)
    flat[ki] = k
    flat[vi] = v


def raw_read(kv_cache: torch.Tensor, order: str, block: int, head: int, offset: int):
    n, d = kv_cache.shape[2], kv_cache.shape[3] // 2
    flat = kv_cache[block, head].reshape(-1)
    ki, vi = raw_kv_index(order, n, d, offset)
    return flat[ki], flat[vi]


# --------------------------------------------------------------------------------------------
# A random batch living in a random paged cache
# --------------------------------------------------------------------------------------------


@dataclass
class PagedBatch:
    kv_cache: torch.Tensor  # [num_blocks, num_kv_heads + meta_slots, N, 2D]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    keys: list[torch.Tensor]  # per request [seq_len, Hkv, D] (as stored, cache dtype)
    values: list[torch.Tensor]
    seq_lens: list[int]
    num_kv_heads: int
    num_head_slots: int
    page_size: int
    head_size: int
    order: str


def random_block_table(seq_lens: list[int], page_size: int, g: torch.Generator, spare: int = 3):
    """Distinct random physical blocks for every logical page; padding entries point at block 0..."""
    pages = [max(1, math.ceil(s / page_size)) for s in seq_lens]
    num_blocks = sum(pages) + spare
    perm = torch.randperm(num_blocks, generator=g)
    width = max(pages) + 2
    # padding columns hold random (valid) blocks: code must never read them
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=g, dtype=torch.int32)
    used = 0
    for r, p in enumerate(pages):
        table[r, :p] = perm[used : used + p].to(torch.int32)
        used += p
    return table, num_blocks


def make_paged_batch(
    seq_lens: list[int],
    num_kv_heads: int,
    page_size: int,
    head_size: int,
    order: str = "planes",
    meta_slots: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """A cache full of random garbage, with each request's random K/V written at its pages."""
    g = gen(seed)
    table, num_blocks = random_block_table(seq_lens, page_size, g)
    slots = num_kv_heads + meta_slots
    kv_cache = randn(num_blocks, slots, page_size, 2 * head_size, g=g, dtype=dtype) * 3.0
    keys, values = [], []
    for r, s in enumerate(seq_lens):
        k = randn(s, num_kv_heads, head_size, g=g, dtype=dtype)
        v = randn(s, num_kv_heads, head_size, g=g, dtype=dtype)
        for pos in range(s):
            block = int(table[r, pos // page_size])
            for h in range(num_kv_heads):
                raw_write(kv_cache, order, block, h, pos % page_size, k[pos, h], v[pos, h])
        keys.append(k)
        values.append(v)
    return PagedBatch(kv_cache, table, keys, values, list(seq_lens), num_kv_heads, slots, page_size, head_size, order)


def query_start_loc(query_lens: list[int]) -> list[int]:
    out = [0]
    for q in query_lens:
        out.append(out[-1] + q)
    return out


# --------------------------------------------------------------------------------------------
# Brute-force attention by true token positions
# --------------------------------------------------------------------------------------------


def brute_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    visible_pages: list[set[int]] | None = None,
    page_size: int = 16,
) -> torch.Tensor:
    """Causal attention of one request, element by element in float64.

    Args:
        q: ``[C, Hq, D]`` queries at positions ``context_len .. context_len + C - 1``.
        k, v: ``[S, Hkv, D]`` token-level keys/values of positions ``0 .. S-1``.
        visible_pages: per KV head, the logical pages whose tokens may be attended (None: all).
    Returns:
        ``[C, Hq, D]`` float64.
    """
    c, hq, d = q.shape
    s, hkv, _ = k.shape
    group = hq // hkv
    q, k, v = q.double(), k.double(), v.double()
    qpos = torch.arange(context_len, context_len + c)[:, None]  # true positions of the queries
    kpos = torch.arange(s)[None, :]  # true positions of the keys
    out = torch.empty(c, hq, d, dtype=torch.float64)
    for h in range(hq):
        kh = h // group
        allowed = kpos <= qpos  # [C, S] causal by true position
        if visible_pages is not None:
            page_ok = torch.tensor([pos // page_size in visible_pages[kh] for pos in range(s)])
            allowed = allowed & page_ok[None, :]
        logits = (q[:, h] @ k[:, kh].T) * scale  # [C, S]
        logits = logits.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(logits, dim=-1) @ v[:, kh]
    return out


def random_selection(plan, hkv: int, g: torch.Generator, pad: int = 2) -> tuple[Selection, dict]:
    """Distinct random non-forced past pages per row, in random order, with garbage padding."""
    rows = len(plan.requests) * hkv
    width = plan.max_select + pad
    indices = torch.randint(0, 1000, (rows, width), generator=g, dtype=torch.int64)
    counts = torch.zeros(rows, dtype=torch.int32)
    chosen = {}
    for r, req in enumerate(plan.requests):
        for kh in range(hkv):
            row = r * hkv + kh
            if not req.sparse:
                chosen[row] = set()
                continue
            forced = set(req.forced.tolist())
            free = [p for p in range(req.num_past_pages) if p not in forced]
            perm = torch.randperm(len(free), generator=g)[: req.num_select].tolist()
            pick = [free[i] for i in perm]
            indices[row, : req.num_select] = torch.tensor(pick, dtype=torch.int64)
            counts[row] = req.num_select
            chosen[row] = set(pick)
    return Selection(indices, counts), chosen


def plant_aligned_keys(kv_cache, layout, block_table, req, hkv: int, group: int, d: int, seed: int = 12):
    """Queries leaning towards one random direction per KV head, and one key per head, 10x along
    that direction, planted in a different non-forced past page per head.

    Returns ``(query [query_len, hkv * group, d], direction [hkv, d], planted {head: (page, block)})``.
    """
    g = gen(seed)
    direction = randn(hkv, d, g=g)
    query = 0.5 * randn(req.query_len, hkv * group, d, g=g)
    for kh in range(hkv):
        query[:, kh * group : (kh + 1) * group] += direction[kh]
    forced = set(req.forced.tolist())
    free = [pg for pg in range(req.num_past_pages) if pg not in forced]
    planted = {}
    for kh, pg in {0: free[len(free) // 3], 1: free[2 * len(free) // 3]}.items():
        block = int(block_table[0, pg])
        layout.keys(kv_cache)[block, kh, 2] = 10 * direction[kh]
        planted[kh] = (pg, block)
    return query, direction, planted
