"""Triton kernels of sparse_quest and sparse_twilight against their torch twins, on random inputs:
Quest page bounds (kernels/quest_score.py), Twilight INT4 mass estimate
(kernels/twilight_estimate.py) and the sync-free metadata writers (kernels/page_meta_write.py),
the latter through the block-reuse simulation of tests/test_page_metadata.py.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``)
at small shapes; see tests/test_kernels_triton.py for the fresh-process trick.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpret import DEVICE, HAS_CUDA, in_process, rerun_in_fresh_process

triton = pytest.importorskip("triton", reason="triton is not installed")

from helpers import gen, query_start_loc, randn, single_thread  # noqa: F401
from test_page_metadata import Sim, run_block_reuse
from test_selector_twilight import paged_batch_with_meta

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.kernels.page_meta_write import write_int4_shadow_triton, write_page_minmax_triton
from vllm_sparse.kernels.quest_score import page_upper_bounds_rows_triton, page_upper_bounds_triton
from vllm_sparse.kernels.twilight_estimate import (
    estimate_page_mass_rows_triton,
    estimate_page_mass_triton,
)
from vllm_sparse.layout import PageMeta
from vllm_sparse.metadata.int4_shadow import dequantize_int4, quantize_int4
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors import QuestSelector, TwilightSelector
from vllm_sparse.selectors.quest import page_upper_bounds, page_upper_bounds_rows
from vllm_sparse.selectors.twilight import estimate_page_mass, estimate_page_mass_rows

test_in_fresh_process = rerun_in_fresh_process(__file__)


def tol(dtype=torch.float32):
    return 1e-5 if dtype == torch.float32 and not HAS_CUDA else 2e-2


# ---------------------------------------------------------------------------------------------
# Quest bounds
# ---------------------------------------------------------------------------------------------


@in_process
@pytest.mark.parametrize("c", [1, 5, 20])
@pytest.mark.parametrize("hkv,group,p", [(2, 1, 37), (1, 4, 70), (2, 2, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quest_bounds_match_twin(c, hkv, group, p, dtype):
    g = gen(c * 100 + hkv * 10 + group + p)
    d, nb = 32, p + 6
    a, b = randn(nb, hkv, d, g=g), randn(nb, hkv, d, g=g)
    kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
    q = randn(c, hkv * group, d, g=g, dtype=dtype)
    blocks = torch.randperm(nb, generator=g)[:p]
    want = page_upper_bounds(q, kmin[blocks].transpose(0, 1), kmax[blocks].transpose(0, 1))
    got = page_upper_bounds_triton(q.to(DEVICE), kmin.to(DEVICE), kmax.to(DEVICE), blocks.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=tol(dtype), atol=tol(dtype))


@in_process
@pytest.mark.parametrize("hkv,group,p", [(2, 1, 37), (1, 4, 70), (2, 3, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quest_rows_bounds_match_twin(hkv, group, p, dtype):
    """Many slots (decode requests) in one launch: per-slot query tokens and page counts."""
    g = gen(hkv * 10 + group + p)
    d, nb, slots = 32, p + 6, 4
    a, b = randn(nb, hkv, d, g=g), randn(nb, hkv, d, g=g)
    kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
    query = randn(9, hkv * group, d, g=g, dtype=dtype)
    tokens = torch.tensor([7, 0, 3, 8])
    blocks = torch.stack([torch.randperm(nb, generator=g)[:p] for _ in range(slots)])
    npages = torch.tensor([p, p // 2, 1, p - 3], dtype=torch.int32)
    want = page_upper_bounds_rows(query[tokens], kmin, kmax, blocks)
    got = page_upper_bounds_rows_triton(
        query.to(DEVICE), kmin.to(DEVICE), kmax.to(DEVICE), tokens.to(DEVICE), blocks.to(DEVICE), npages.to(DEVICE)
    ).cpu()
    for row in range(slots * hkv):
        m = int(npages[row // hkv])
        torch.testing.assert_close(got[row, :, :m], want[row, :, :m], rtol=tol(dtype), atol=tol(dtype))
        assert bool((got[row, :, m:] == float("-inf")).all())


@in_process
@pytest.mark.skipif(HAS_CUDA, reason="CPU caches; the GPU pipeline is tests/gpu/test_quest_twilight_gpu.py")
@pytest.mark.parametrize("rule", ["max", "sum", "union"])
def test_quest_selector_triton_path_selects_like_twin(rule, monkeypatch):
    """The selector with the kernel behind its dispatch picks the twin's pages (float32 cache)."""
    from vllm_sparse.selectors import quest

    n, d, hkv, group = 4, 16, 2, 2
    reqs = [(13, 97), (1, 83), (1, 130)]
    batch, layout, meta = paged_batch_with_meta([s for _, s in reqs], hkv, n, d, seed=2)
    qsl = query_start_loc([q for q, _ in reqs])
    policy = LayerPolicy(False, Budget(fraction=0.3, min_tokens=0, max_tokens=None), 4, 8, 0)
    plan = plan_step(policy, n, qsl, [s for _, s in reqs])
    query = randn(qsl[-1], hkv * group, d, g=gen(3))
    args = (query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta)
    want = QuestSelector(rule)(*args)
    monkeypatch.setattr(quest, "_triton_ok", lambda q, m: True)  # the kernels on CPU tensors (interpreter)
    got = QuestSelector(rule)(*args)
    assert torch.equal(got.counts, want.counts)
    for row in range(want.counts.numel()):
        k = int(want.counts[row])
        assert set(got.indices[row, :k].tolist()) == set(want.indices[row, :k].tolist()), row


# ---------------------------------------------------------------------------------------------
# Twilight INT4 estimate
# ---------------------------------------------------------------------------------------------


@in_process
@pytest.mark.parametrize("c", [1, 20, 40])
@pytest.mark.parametrize("hkv,group,p,n,d", [(2, 2, 37, 4, 32), (1, 4, 9, 16, 64), (2, 1, 70, 4, 16)])
def test_twilight_mass_matches_twin(c, hkv, group, p, n, d):
    g = gen(c + 7 * p + n)
    nb = p + 5
    keys = randn(nb, hkv, n, d, g=g) * 2
    codes, scale, zero = quantize_int4(keys)
    q = randn(c, hkv * group, d, g=g) * 2
    blocks = torch.stack([torch.randperm(nb, generator=g)[:p] for _ in range(hkv)])  # per KV head
    heads = torch.arange(hkv)[:, None]
    deq = dequantize_int4(codes[blocks, heads], scale[blocks, heads], zero[blocks, heads]).flatten(1, 2)
    want = estimate_page_mass(q, deq, n, 0.3)
    got = estimate_page_mass_triton(
        q.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), blocks.to(DEVICE), 0.3
    ).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 if not HAS_CUDA else 1e-4)
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(hkv, group), rtol=1e-4, atol=1e-4)


@in_process
@pytest.mark.parametrize("hkv,group,n,d", [(2, 2, 4, 32), (1, 4, 16, 64), (2, 3, 4, 16)])
def test_twilight_rows_mass_matches_twin(hkv, group, n, d):
    """Many slots in one launch, per-row page lists with ``-1`` padding (zero mass)."""
    g = gen(7 * n + d + group)
    nb, slots, p = 40, 3, 13
    keys = randn(nb, hkv, n, d, g=g) * 2
    codes, scale, zero = quantize_int4(keys)
    q = randn(slots, hkv * group, d, g=g) * 2
    blocks = torch.stack([torch.randperm(nb, generator=g)[:p] for _ in range(slots * hkv)])
    lens = torch.randint(1, p + 1, (slots * hkv,), generator=g)
    pad = torch.arange(p)[None, :] >= lens[:, None]
    pad[0, 2] = True  # padding inside a row too
    blocks = blocks.masked_fill(pad, -1)
    want = estimate_page_mass_rows(q, PageMeta(None, None, codes, scale, zero), blocks, n, 0.3)
    got = estimate_page_mass_rows_triton(
        q.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), blocks.to(DEVICE), 0.3
    ).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 if not HAS_CUDA else 1e-4)
    assert bool((got.masked_select(pad[:, None, :].expand_as(got)) == 0).all())
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(slots * hkv, group), rtol=1e-4, atol=1e-4)


@in_process
@pytest.mark.skipif(HAS_CUDA, reason="CPU caches; the GPU pipeline is tests/gpu/test_quest_twilight_gpu.py")
@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_twilight_selector_triton_path_selects_like_twin(top_p, monkeypatch):
    from vllm_sparse.selectors import twilight

    n, d, hkv, group = 4, 16, 2, 2
    reqs = [(13, 97), (1, 83), (1, 130)]
    batch, layout, meta = paged_batch_with_meta([s for _, s in reqs], hkv, n, d, seed=4)
    qsl = query_start_loc([q for q, _ in reqs])
    policy = LayerPolicy(False, Budget(fraction=0.5, min_tokens=0, max_tokens=None), 4, 8, 0)
    plan = plan_step(policy, n, qsl, [s for _, s in reqs])
    query = randn(qsl[-1], hkv * group, d, g=gen(5)) * 3
    args = (query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta)
    want = TwilightSelector(QuestSelector(), top_p)(*args)
    monkeypatch.setattr(twilight, "_triton_ok", lambda q: True)  # the kernels on CPU tensors (interpreter)
    got = TwilightSelector(QuestSelector(), top_p)(*args)
    assert torch.equal(got.counts, want.counts) and len(set(got.counts.tolist())) > 1
    for row in range(want.counts.numel()):
        k = int(want.counts[row])
        assert set(got.indices[row, :k].tolist()) == set(want.indices[row, :k].tolist()), row


# ---------------------------------------------------------------------------------------------
# Decode batching through the kernels: batched selection == per-request selection of the step
# ---------------------------------------------------------------------------------------------


@in_process
@pytest.mark.skipif(HAS_CUDA, reason="CPU caches; the GPU pipeline is tests/gpu/test_quest_twilight_gpu.py")
@pytest.mark.parametrize("method", ["max", "sum", "union", "twilight"])
def test_decode_batch_through_kernels_selects_like_per_request(method, monkeypatch):
    """Decode requests of different lengths + a prefill chunk + dense requests: the batched
    kernels select what the per-request kernels and the per-request torch twins select."""
    from test_selector_quest import assert_same_selection
    from test_selector_twilight import MIXED

    from vllm_sparse.selectors import quest, twilight

    n, d, hkv, group = 4, 16, 2, 2
    batch, layout, meta = paged_batch_with_meta([s for _, s in MIXED], hkv, n, d, seed=12)
    qsl = query_start_loc([q for q, _ in MIXED])
    policy = LayerPolicy(False, Budget(fraction=0.5, min_tokens=0, max_tokens=None), 4, 8, 0)
    plan = plan_step(policy, n, qsl, [s for _, s in MIXED])
    assert sum(r.sparse and r.query_len == 1 for r in plan.requests) >= 4
    assert any(r.sparse and r.query_len > 1 for r in plan.requests) and not all(r.sparse for r in plan.requests)
    query = randn(qsl[-1], hkv * group, d, g=gen(13)) * 3

    def make(batched):
        rule = "max" if method == "twilight" else method
        base = QuestSelector(rule, batch_decode=batched)
        return TwilightSelector(base, 0.8, batch_decode=batched) if method == "twilight" else base

    args = (query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta)
    twin = make(False)(*args)
    monkeypatch.setattr(quest, "_triton_ok", lambda q, m: True)  # the kernels on CPU tensors (interpreter)
    monkeypatch.setattr(twilight, "_triton_ok", lambda q: True)
    per_request = make(False)(*args)
    got = make(True)(*args)
    assert_same_selection(per_request, twin)
    assert_same_selection(got, per_request)
    if method == "twilight":
        assert len(set(got.counts.tolist())) > 2


# ---------------------------------------------------------------------------------------------
# Sync-free metadata writers through block reuse (bit-exact with the torch writers)
# ---------------------------------------------------------------------------------------------

TRITON_WRITERS = (write_page_minmax_triton, write_int4_shadow_triton)


@in_process
@pytest.mark.parametrize("order", ["planes", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,n,d", [(2, 8, 16), (3, 16, 8)])
def test_triton_metadata_writers_through_block_reuse(order, dtype, hkv, n, d):
    if HAS_CUDA:  # the simulation keeps its cache on the CPU
        pytest.skip("covered on the GPU by tests/gpu/test_quest_twilight_gpu.py")
    run_block_reuse(Sim(order, hkv, n, d, dtype, num_blocks=6, seed=n + 10 * hkv, writers=TRITON_WRITERS))


@in_process
@pytest.mark.skipif(HAS_CUDA, reason="the simulation keeps its cache on the CPU; see tests/gpu")
def test_triton_writers_skip_padding_and_match_torch_writers_exactly():
    ref = Sim("interleaved", 2, 4, 16, torch.bfloat16, num_blocks=5, seed=3)
    tri = Sim("interleaved", 2, 4, 16, torch.bfloat16, num_blocks=5, seed=3, writers=TRITON_WRITERS)
    for sim in (ref, tri):
        sim.step([(3, [0, 1, 2]), (1, [0])])
        sim.step([(3, [3]), (1, [1, 2])])
    assert torch.equal(ref.cache, tri.cache)  # K/V, min/max, codes, scale, zero: every byte
    before = tri.cache.clone()
    write_page_minmax_triton(tri.layout, tri.cache, tri.meta, torch.full((4,), -1))
    write_int4_shadow_triton(tri.meta, torch.ones(4, 2, 16), torch.full((4,), -1), 4, torch.bfloat16)
    assert torch.equal(before, tri.cache)
