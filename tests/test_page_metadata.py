"""Page metadata: the planes in vllm_sparse/layout.py, the Quest min/max writer
(vllm_sparse/metadata/page_minmax.py) and the INT4 key shadow (vllm_sparse/metadata/int4_shadow.py),
through block reuse, prefix-cache style partial rewrites and recompute, against a recompute from
the keys each block holds."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    gen,
    randn,
    raw_read,
    single_thread,  # noqa: F401  (autouse fixture: one torch thread)
)

from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.int4_shadow import dequantize_int4, quantize_int4, write_int4_shadow
from vllm_sparse.metadata.minmax_int8 import encode_minmax_int8
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.metadata.writer import write_kv_reference

ORDERS = ["planes", "interleaved"]


# ---------------------------------------------------------------------------------------------
# Planes
# ---------------------------------------------------------------------------------------------


def test_methods_without_metadata_get_no_planes():
    for method in ("quoka", "kascade", "compact"):
        assert MetaPlanes.for_method(method, 8, 16, 128, torch.bfloat16) is None


@pytest.mark.parametrize(
    "method,hkv,n,d,dtype,want_bytes,want_slots",
    [
        # Llama-3.1-8B shapes, bf16, page 16: a slot is 16 * 256 * 2 = 8192 bytes; the INT8 codes of the
        # min/max (2 * 8 * 128 bytes and 8 float32 scales) fit the same slot
        ("quest", 8, 16, 128, torch.bfloat16, 2 * 8 * 128 * 2 + 2 * 8 * 128 + 8 * 4, 1),
        ("twilight", 8, 16, 128, torch.bfloat16, 6176 + 8 * 16 * 64 + 2 * 8 * 16 * 2, 2),
        # the tiny test model: 2 KV heads, d 64, fp32, page 32
        ("quest", 2, 32, 64, torch.float32, 2 * 2 * 64 * 4 + 2 * 2 * 64 + 2 * 4, 1),
        ("twilight", 2, 32, 64, torch.float32, 1296 + 2 * 32 * 32 + 2 * 2 * 32 * 2, 1),  # (1288 aligned to 16)
        # more KV heads than tokens per page: min/max and codes spill into more slots of 256 bytes
        ("quest", 8, 4, 16, torch.float16, 2 * 8 * 16 * 2 + 2 * 8 * 16 + 8 * 4, 4),
    ],
)
def test_plane_sizes(method, hkv, n, d, dtype, want_bytes, want_slots):
    p = MetaPlanes.for_method(method, hkv, n, d, dtype)
    assert p.num_bytes == want_bytes
    assert p.num_slots == want_slots


@pytest.mark.parametrize("method", ["quest", "twilight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hkv,n,d", [(1, 16, 8), (3, 4, 16), (2, 32, 64)])
def test_plane_views_are_disjoint_views_of_the_meta_slots(method, dtype, hkv, n, d):
    p = MetaPlanes.for_method(method, hkv, n, d, dtype)
    nb = 5
    cache = torch.zeros(nb, hkv + p.num_slots, n, 2 * d, dtype=dtype)
    meta = p.views(cache)
    base = cache.data_ptr()
    block_bytes = cache.stride(0) * cache.element_size()
    meta_lo = hkv * n * 2 * d * cache.element_size()  # metadata slots start after the K/V heads
    seen = torch.zeros(nb * block_bytes, dtype=torch.int32)
    for t in meta:
        if t is None:
            continue
        assert t.shape[0] == nb
        assert t.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()  # a view
        # mark every byte the plane covers
        for b in range(nb):
            start = t[b].data_ptr() - base
            size = t[b].numel() * t.element_size()
            assert t[b].is_contiguous()
            assert start % 16 == 0 or start - b * block_bytes >= meta_lo
            assert meta_lo <= start - b * block_bytes and start - b * block_bytes + size <= block_bytes
            seen[start : start + size] += 1
    assert int(seen.max()) == 1  # planes never overlap
    # writing through the views leaves the K/V heads alone
    for t in meta:
        if t is not None:
            t.fill_(3)
    assert torch.count_nonzero(cache[:, :hkv]) == 0


def test_views_refuse_a_cache_without_room():
    p = MetaPlanes.for_method("twilight", 8, 16, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="no room"):
        p.views(torch.zeros(2, 9, 16, 256, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# INT4 quantization
# ---------------------------------------------------------------------------------------------


def brute_pack(q: list[int]) -> list[int]:
    return [q[2 * i] + 16 * q[2 * i + 1] for i in range(len(q) // 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_roundtrip_error_and_packing(dtype):
    g = gen(3)
    k = (randn(50, 3, 32, g=g) * 2 + 0.5).to(dtype)
    k[0, 0] = 1.25  # constant vector
    codes, scale, zero = quantize_int4(k)
    assert codes.dtype == torch.uint8 and codes.shape == (50, 3, 16)
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == (50, 3)
    deq = dequantize_int4(codes, scale, zero)
    x = k.float()
    # every channel within half a step (plus fp16 rounding of scale/zero) of the stored key
    step = scale.float()[..., None]
    err = (deq - x).abs()
    bound = step / 2 + 2e-3 * x.abs().amax(dim=-1, keepdim=True) + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(deq[0, 0], torch.full((32,), 1.25))
    # packing: channel 2i in the low nibble
    for t, h in [(1, 0), (7, 2), (49, 1)]:
        q = [round((float(x[t, h, c]) - float(zero[t, h])) / float(scale[t, h])) for c in range(32)]
        q = [min(15, max(0, v)) for v in q]
        assert codes[t, h].tolist() == brute_pack(q)


# ---------------------------------------------------------------------------------------------
# Writers through block reuse
# ---------------------------------------------------------------------------------------------


class Sim:
    """A paged cache written step by step like vLLM does, with a record of what each block holds."""

    def __init__(self, order, hkv, n, d, dtype, num_blocks, seed, writers=None):
        """``writers``: ``(minmax, int4)`` metadata writers (default: the torch ones); the Triton
        variants are run through this same simulation in tests/test_kernels_triton_quest_twilight.py."""
        self.write_minmax, self.write_int4 = writers or (write_page_minmax, write_int4_shadow)
        self.g = gen(seed)
        self.hkv, self.n, self.d, self.dtype, self.order = hkv, n, d, dtype, order
        self.planes = MetaPlanes.for_method("twilight", hkv, n, d, dtype)
        slots = hkv + self.planes.num_slots
        # never zeroed: random garbage everywhere, metadata included
        self.cache = randn(num_blocks, slots, n, 2 * d, g=self.g, dtype=dtype) * 4 + 3
        self.layout = PageLayout.of(self.cache, hkv, order)
        self.meta = self.planes.views(self.cache)
        self.fill: dict[int, int] = {}  # block -> valid tokens of its current owner

    def step(self, writes: list[tuple[int, list[int]]], pad: int = 2, extra_rows: int = 3, keys=None):
        """One ``do_kv_cache_update``: ``writes`` = (block, offsets) pairs; returns the keys written."""
        slots = [b * self.n + o for b, offs in writes for o in offs]
        t = len(slots)
        k = randn(t, self.hkv, self.d, g=self.g) * 1.5 if keys is None else keys
        v = randn(t, self.hkv, self.d, g=self.g)
        # vLLM pads: -1 slots among the real ones, and key rows past the slot mapping
        perm = torch.randperm(t + pad, generator=self.g)
        slot_mapping = torch.full((t + pad,), -1, dtype=torch.int64)
        kk = randn(t + pad + extra_rows, self.hkv, self.d, g=self.g) * 100
        vv = torch.zeros_like(kk)
        for i, s in enumerate(slots):
            slot_mapping[perm[i]] = s
            kk[perm[i]], vv[perm[i]] = k[i], v[i]
        write_kv_reference(self.layout, self.cache, kk, vv, slot_mapping)
        self.write_minmax(self.layout, self.cache, self.meta, slot_mapping)
        self.write_int4(self.meta, kk, slot_mapping, self.n, self.dtype)
        for b, offs in writes:
            if 0 in offs:
                self.fill[b] = 0  # a new owner starts the page
            self.fill[b] = max(self.fill.get(b, 0), max(offs) + 1)
        return k

    def check(self):
        """Stored metadata == a recompute from the keys each block holds now (raw reads)."""
        for b, fill in self.fill.items():
            for h in range(self.hkv):
                keys = torch.stack([raw_read(self.cache, self.order, b, h, o)[0] for o in range(fill)])
                assert torch.equal(self.meta.kmin[b, h], keys.amin(dim=0)), (b, h)
                assert torch.equal(self.meta.kmax[b, h], keys.amax(dim=0)), (b, h)
                lo, hi, scale = encode_minmax_int8(keys.amin(dim=0), keys.amax(dim=0))
                assert torch.equal(self.meta.kmin8[b, h], lo) and torch.equal(self.meta.kmax8[b, h], hi), (b, h)
                assert torch.equal(self.meta.mscale[b, h], scale), (b, h)
                codes, scale, zero = quantize_int4(keys)
                assert torch.equal(self.meta.codes[b, h, :fill], codes), (b, h)
                assert torch.equal(self.meta.scale[b, h, :fill], scale) and torch.equal(self.meta.zero[b, h, :fill], zero)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,n,d", [(2, 8, 16), (1, 4, 8), (3, 16, 8)])
def test_metadata_through_block_reuse(order, dtype, hkv, n, d):
    run_block_reuse(Sim(order, hkv, n, d, dtype, num_blocks=6, seed=n + 10 * hkv + (order == "planes")))


def run_block_reuse(sim: Sim) -> None:
    """Prefill, decode, reuse, partial rewrite and recompute steps, checked after each."""
    n, hkv, order = sim.n, sim.hkv, sim.order
    full = list(range(n))
    half = n // 2
    # request A: a prefill chunk over blocks 2, 4 (full) and 1 (partial), then decode steps
    sim.step([(2, full), (4, full), (1, list(range(half)))])
    sim.check()
    sim.step([(1, [half])])
    sim.check()
    # a chunk that continues inside a page and crosses into a fresh one (mixed with another request's first chunk)
    sim.step([(1, list(range(half + 1, n))), (5, [0, 1]), (3, list(range(n - 1)))])
    sim.check()
    # A finishes; its blocks are freed and reused, never zeroed. B gets a prefix hit on block 2
    # (untouched) and block 4 is reallocated and refilled from offset 0 with fewer tokens.
    sim.step([(4, [0, 1])])
    sim.check()
    # prefix-cache style partial page rewrite: block 1 (full with A's keys) is taken by a new owner
    # who writes only its first tokens
    sim.step([(1, list(range(half - 1)))])
    sim.check()
    # the "recompute the last token" path: the same key rewritten into a cached full block
    b = 2
    same = torch.stack([raw_read(sim.cache, order, b, hh, n - 1)[0] for hh in range(hkv)])[None]
    before = [t[b].clone() for t in sim.meta]
    sim.step([(b, [n - 1])], keys=same.float())
    sim.check()
    for t0, t in zip(before, sim.meta):
        assert torch.equal(t0, t[b])  # idempotent
    # untouched blocks keep their metadata (block 0 never written: stays garbage)
    assert 0 not in sim.fill


def test_single_token_pages_and_all_padding_step():
    sim = Sim("planes", 2, 1, 8, torch.float32, num_blocks=4, seed=1)
    sim.step([(3, [0]), (1, [0])])
    sim.check()
    before = sim.cache.clone()
    write_page_minmax(sim.layout, sim.cache, sim.meta, torch.full((4,), -1))
    write_int4_shadow(sim.meta, torch.ones(4, 2, 8), torch.full((4,), -1), 1)
    assert torch.equal(before, sim.cache)


# ---------------------------------------------------------------------------------------------
# Backend spec: only metadata methods get extra head slots
# ---------------------------------------------------------------------------------------------


def test_customize_spec_adds_slots_only_for_metadata_methods():
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_sparse.backend import backends as bk

    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert bk.SparseQuokaBackend.customize_spec(spec).num_heads == 8
    quest = bk.SparseQuestBackend.customize_spec(spec)
    twilight = bk.SparseTwilightBackend.customize_spec(spec)
    assert (quest.num_head_slots, twilight.num_head_slots) == (9, 10)
    assert quest.page_size_bytes == spec.page_size_bytes * 9 // 8
    assert twilight.page_size_bytes == spec.page_size_bytes * 10 // 8
