"""Layout and K/V write: vllm_sparse/layout.py + vllm_sparse/metadata/writer.py, checked against raw
index arithmetic on the cache tensor (tests/helpers.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    gen,
    randn,
    raw_read,
    raw_write,
    single_thread,  # noqa: F401  (autouse fixture: one torch thread)
)

from vllm_sparse.layout import PageLayout
from vllm_sparse.metadata import write_kv_reference

ORDERS = ["planes", "interleaved"]


def random_cache(num_blocks, slots, n, d, dtype, seed):
    return randn(num_blocks, slots, n, 2 * d, g=gen(seed), dtype=dtype) * 5 + 1


def random_slots(num_blocks, n, t, num_pad, g, slot_dtype=torch.int64):
    """``t`` distinct slots, ``num_pad`` of them replaced by -1 at random positions."""
    slots = torch.randperm(num_blocks * n, generator=g)[:t]
    if num_pad:
        pad_at = torch.randperm(t, generator=g)[:num_pad]
        slots[pad_at] = -1
    return slots.to(slot_dtype)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("hkv,meta_slots", [(1, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("n,d", [(1, 4), (4, 8), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_pad,extra_rows", [(0, 0), (3, 0), (0, 5), (4, 7)])
def test_write_then_read_back(order, hkv, meta_slots, n, d, dtype, num_pad, extra_rows):
    num_blocks, t = 6, 11
    seed = n + 10 * hkv + 100 * num_pad + 1000 * extra_rows + (order == "planes")
    g = gen(seed)
    slots_total = hkv + meta_slots
    cache = random_cache(num_blocks, slots_total, n, d, dtype, seed)
    before = cache.clone()
    slot_mapping = random_slots(
        num_blocks, n, min(t, num_blocks * n), num_pad, g, torch.int64 if n > 1 else torch.int32
    )
    t = slot_mapping.shape[0]
    # keys longer than slot_mapping (vLLM pads them); fp32 input into a cache of another dtype too
    key = randn(t + extra_rows, hkv, d, g=g)
    value = randn(t + extra_rows, hkv, d, g=g)
    layout = PageLayout.of(cache, hkv, order)
    assert (layout.num_kv_heads, layout.num_head_slots, layout.page_size, layout.head_size) == (hkv, slots_total, n, d)
    assert layout.num_meta_slots == meta_slots

    write_kv_reference(layout, cache, key, value, slot_mapping)

    # the whole cache equals the brute-force expectation: written slots changed, nothing else
    expect = before.clone()
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        for h in range(hkv):
            raw_write(expect, order, s // n, h, s % n, key[i, h].to(dtype), value[i, h].to(dtype))
    assert torch.equal(cache, expect)
    assert torch.equal(layout.meta(cache), before[:, hkv:])  # metadata slots untouched

    keys, values = layout.keys(cache), layout.values(cache)
    pk, pv = layout.page_keys(cache), layout.page_values(cache)
    assert keys.shape == values.shape == (num_blocks, hkv, n, d)
    assert pk.shape == pv.shape == (num_blocks * slots_total, n, d)
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, off = s // n, s % n
        for h in range(hkv):
            kk, vv = key[i, h].to(dtype), value[i, h].to(dtype)
            assert torch.equal(keys[b, h, off], kk) and torch.equal(values[b, h, off], vv)
            pid = int(layout.page_ids(torch.tensor(b), torch.tensor(h)))
            assert pid == b * slots_total + h
            assert torch.equal(pk[pid, off], kk) and torch.equal(pv[pid, off], vv)
    # every K/V entry of the views agrees with the raw addressing, written or not
    for b in range(num_blocks):
        for h in range(hkv):
            for off in range(n):
                rk, rv = raw_read(cache, order, b, h, off)
                assert torch.equal(keys[b, h, off], rk) and torch.equal(values[b, h, off], rv)
                assert torch.equal(pk[b * slots_total + h, off], rk)


@pytest.mark.parametrize("order", ORDERS)
def test_all_padding_writes_nothing(order):
    cache = random_cache(3, 3, 4, 8, torch.float32, 1)
    before = cache.clone()
    layout = PageLayout.of(cache, 2, order)
    key = randn(5, 2, 8, g=gen(2))
    write_kv_reference(layout, cache, key, key + 1, torch.full((5,), -1, dtype=torch.int64))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("order", ORDERS)
def test_empty_step_writes_nothing(order):
    cache = random_cache(3, 2, 4, 8, torch.float32, 1)
    before = cache.clone()
    layout = PageLayout.of(cache, 2, order)
    key = randn(4, 2, 8, g=gen(2))  # padded rows only
    write_kv_reference(layout, cache, key, key, torch.empty(0, dtype=torch.int64))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("meta_slots", [0, 2])
def test_views_are_views(order, meta_slots):
    hkv, n, d = 2, 4, 8
    cache = random_cache(3, hkv + meta_slots, n, d, torch.float32, 3)
    layout = PageLayout.of(cache, hkv, order)
    ptr = cache.untyped_storage().data_ptr()
    for view in (layout.keys(cache), layout.values(cache), layout.page_keys(cache), layout.page_values(cache)):
        assert view.untyped_storage().data_ptr() == ptr
    if meta_slots:
        assert layout.meta(cache).untyped_storage().data_ptr() == ptr
        assert layout.meta(cache).shape == (3, meta_slots, n, 2 * d)
    layout.keys(cache)[2, 1, 3] = 123.0
    layout.values(cache)[0, 0, 1] = -7.0
    rk, _ = raw_read(cache, order, 2, 1, 3)
    _, rv = raw_read(cache, order, 0, 0, 1)
    assert bool((rk == 123.0).all()) and bool((rv == -7.0).all())


@pytest.mark.parametrize("hkv,meta_slots", [(1, 0), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planes_order_is_what_vllm_cpu_attn_writes(hkv, meta_slots, dtype):
    """Ground truth: vLLM's own CPU writer with the ``vec`` packing its kernel reads."""
    ops = pytest.importorskip("vllm._custom_ops", reason="needs vLLM's CPU ops")
    b, n, d = 4, 32, 64
    slots = hkv + meta_slots
    ours = random_cache(b, slots, n, d, dtype, 9)
    theirs = ours.clone()
    key = randn(5, hkv, d, g=gen(10), dtype=dtype)
    value = randn(5, hkv, d, g=gen(11), dtype=dtype)
    slot_mapping = torch.tensor([5, 2 * n + 7, 3 * n, n - 1, 2 * n])
    layout = PageLayout.of(ours, hkv, "planes")
    write_kv_reference(layout, ours, key, value, slot_mapping)
    k_cache, v_cache = theirs[:, :hkv].reshape(b, hkv, 2 * n, d).chunk(2, dim=2)  # a copy: K/V slots only
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, "vec")
    assert torch.equal(ours[:, :hkv].reshape(b, hkv, 2 * n, d), torch.cat([k_cache, v_cache], dim=2))
    assert torch.equal(ours[:, hkv:], theirs[:, hkv:])  # metadata slots untouched


def test_interleaved_order_is_k_then_v_per_token():
    b, hkv, n, d = 2, 2, 4, 8
    cache = random_cache(b, hkv, n, d, torch.float32, 4)
    layout = PageLayout.of(cache, hkv, "interleaved")
    assert torch.equal(layout.keys(cache), cache[..., :d])
    assert torch.equal(layout.values(cache), cache[..., d:])


def test_page_ids_broadcast():
    layout = PageLayout(num_kv_heads=2, num_head_slots=3, page_size=16, head_size=64, order="planes")
    blocks = torch.tensor([[4, 0, 7]])
    heads = torch.tensor([[0], [1]])
    ids = layout.page_ids(blocks, heads)
    assert ids.tolist() == [[12, 0, 21], [13, 1, 22]]
