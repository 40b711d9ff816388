"""sparse_quest / sparse_twilight GPU parts at Llama-3.1-8B layer shapes (32 query heads, 8 KV
heads, d 128, bf16, pages of 16): Triton kernels vs their torch twins, the sync-free metadata
writers bit-exact with the torch writers, and the Triton paged executor with variable per-row
page counts vs the reference executor; the per-layer paths run under ``set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_skip import no_sync, require_cuda

require_cuda()

from vllm_sparse.config import Budget, LayerPolicy  # noqa: E402
from vllm_sparse.executors.reference import reference_executor  # noqa: E402
from vllm_sparse.executors.triton_paged import TritonPagedExecutor  # noqa: E402
from vllm_sparse.kernels.quest_score import page_upper_bounds_triton  # noqa: E402
from vllm_sparse.kernels.twilight_estimate import estimate_page_mass_triton  # noqa: E402
from vllm_sparse.layout import MetaPlanes, PageLayout  # noqa: E402
from vllm_sparse.metadata.int4_shadow import dequantize_int4, quantize_int4, write_int4_shadow  # noqa: E402
from vllm_sparse.metadata.page_minmax import write_page_minmax  # noqa: E402
from vllm_sparse.policy import plan_step  # noqa: E402
from vllm_sparse.selectors import QuestSelector, TwilightSelector  # noqa: E402
from vllm_sparse.selectors.quest import page_upper_bounds  # noqa: E402
from vllm_sparse.selectors.twilight import estimate_page_mass  # noqa: E402
from vllm_sparse.tables import build_page_tables  # noqa: E402

DEV = "cuda"
HQ, HKV, D, N = 32, 8, 128, 16


def rng(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


@pytest.mark.parametrize("c,pages", [(1, 2000), (64, 700), (2048, 300)])
def test_quest_bounds_llama_shapes(c, pages):
    g = rng(c + pages)
    nb = pages + 40
    a = torch.randn(nb, HKV, D, device=DEV, generator=g)
    b = torch.randn(nb, HKV, D, device=DEV, generator=g)
    kmin, kmax = torch.minimum(a, b).bfloat16(), torch.maximum(a, b).bfloat16()
    q = torch.randn(c, HQ, D, device=DEV, generator=g).bfloat16()
    blocks = torch.randperm(nb, device=DEV, generator=g)[:pages]
    want = page_upper_bounds(q, kmin[blocks].transpose(0, 1), kmax[blocks].transpose(0, 1))
    with no_sync():
        got = page_upper_bounds_triton(q, kmin, kmax, blocks)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("c,pages", [(1, 2048), (16, 500), (512, 256)])
def test_twilight_mass_llama_shapes(c, pages):
    g = rng(c * 7 + pages)
    nb = pages + 40
    keys = torch.randn(nb, HKV, N, D, device=DEV, generator=g).bfloat16()
    codes, scale, zero = quantize_int4(keys)
    q = torch.randn(c, HQ, D, device=DEV, generator=g).bfloat16() * 2
    blocks = torch.stack([torch.randperm(nb, device=DEV, generator=g)[:pages] for _ in range(HKV)])
    heads = torch.arange(HKV, device=DEV)[:, None]
    deq = dequantize_int4(codes[blocks, heads], scale[blocks, heads], zero[blocks, heads]).flatten(1, 2)
    want = estimate_page_mass(q, deq, N, D**-0.5)
    with no_sync():
        got = estimate_page_mass_triton(q, codes, scale, zero, blocks, D**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


def _random_slots(nb, t, g):
    slots = torch.randperm(nb * N, device=DEV, generator=g)[:t]
    slots[:: max(2, t // 5)] = -1
    return slots


@pytest.mark.parametrize("t", [1, 37, 4096])
def test_metadata_writers_bit_exact_through_reuse(t):
    """Three steps on the same blocks (fresh pages, partial rewrites of reused pages, a full
    refill): the Triton writers on the GPU and the torch writers on the CPU agree on every byte."""
    g = rng(t)
    planes = MetaPlanes.for_method("twilight", HKV, N, D, torch.bfloat16)
    nb = max(8, 2 * t // N)
    cache = torch.randn(nb, HKV + planes.num_slots, N, 2 * D, device=DEV, generator=g).bfloat16() * 3
    ref = cache.cpu()
    layout = PageLayout.of(cache, HKV, "interleaved")
    meta, ref_meta = planes.views(cache), planes.views(ref)
    for step in range(3):
        slots = _random_slots(nb, t, g)
        qkv = torch.randn(t + 3, HQ + 2 * HKV, D, device=DEV, generator=g).bfloat16()
        key, value = qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]  # strided, as vLLM passes them
        keep = slots >= 0
        blocks, offs = slots[keep] // N, slots[keep] % N
        layout.keys(cache)[blocks, :, offs] = key[:t][keep]
        layout.values(cache)[blocks, :, offs] = value[:t][keep]
        layout.keys(ref)[blocks.cpu(), :, offs.cpu()] = key[:t][keep].cpu()
        layout.values(ref)[blocks.cpu(), :, offs.cpu()] = value[:t][keep].cpu()
        torch.cuda.synchronize()
        with no_sync():
            write_page_minmax(layout, cache, meta, slots)  # dispatches to Triton on CUDA
            write_int4_shadow(meta, key, slots, N, cache.dtype)
        write_page_minmax(layout, ref, ref_meta, slots.cpu())
        write_int4_shadow(ref_meta, key.cpu(), slots.cpu(), N, ref.dtype)
        assert torch.equal(cache.cpu().view(torch.int16), ref.view(torch.int16)), step


def test_cuda_dispatch_uses_triton(monkeypatch):
    import vllm_sparse.kernels.page_meta_write as pmw

    calls = []
    monkeypatch.setattr(pmw, "write_page_minmax_triton", lambda *a: calls.append("minmax"))
    monkeypatch.setattr(pmw, "write_int4_shadow_triton", lambda *a: calls.append("int4"))
    cache = torch.zeros(2, 2, N, 2 * D, device=DEV)
    write_page_minmax(PageLayout.of(cache, 1, "interleaved"), cache, None, torch.zeros(1, device=DEV))
    write_int4_shadow(None, torch.zeros(1, 1, D, device=DEV), torch.zeros(1, device=DEV), N)
    assert calls == ["minmax", "int4"]


# ---------------------------------------------------------------------------------------------
# Executor and the whole twilight pipeline
# ---------------------------------------------------------------------------------------------


def _batch(reqs, seed):
    """A random bf16 cache with twilight planes written for every token of the requests."""
    g = rng(seed)
    planes = MetaPlanes.for_method("twilight", HKV, N, D, torch.bfloat16)
    pages = [-(-s // N) for _, s in reqs]
    nb = sum(pages) + 16
    cache = torch.randn(nb, HKV + planes.num_slots, N, 2 * D, device=DEV, generator=g).bfloat16()
    perm = torch.randperm(nb, device=DEV, generator=g)
    table = torch.zeros(len(reqs), max(pages), dtype=torch.int32, device=DEV)
    used = 0
    for r, p in enumerate(pages):
        table[r, :p] = perm[used : used + p].int()
        used += p
    layout = PageLayout.of(cache, HKV, "interleaved")
    meta = planes.views(cache)
    slots = torch.cat([table[r, torch.arange(s, device=DEV) // N].long() * N + torch.arange(s, device=DEV) % N
                       for r, (_, s) in enumerate(reqs)])  # fmt: skip
    keys = layout.keys(cache)[slots // N, :, slots % N]
    write_page_minmax(layout, cache, meta, slots)
    write_int4_shadow(meta, keys, slots, N, cache.dtype)
    qsl = [0]
    for q, _ in reqs:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], HQ, D, device=DEV, generator=g).bfloat16() * 2
    return cache, table, layout, meta, qsl, query


CASES = {
    "decode_b32": [(1, 4096 + 37 * i) for i in range(32)],
    "mixed": [(1, 8000), (512, 9000), (1, 3000), (77, 6000)],
    "decode_b1_long": [(1, 65536)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_twilight_pipeline_matches_reference_executor_without_sync(case):
    reqs = CASES[case]
    cache, table, layout, meta, qsl, query = _batch(reqs, seed=len(reqs))
    policy = LayerPolicy(False, Budget(fraction=0.125, min_tokens=0, max_tokens=None), 16, 256, 1024, 0.25)
    plan = plan_step(policy, N, qsl, [s for _, s in reqs])
    assert any(r.sparse for r in plan.requests)
    selector = TwilightSelector(QuestSelector("max", D**-0.5), 0.95, D**-0.5)
    pk, pv = layout.page_keys(cache), layout.page_values(cache)
    ex = TritonPagedExecutor()
    out = torch.empty_like(query)
    sel = selector(query, pk, table, layout, plan, meta)  # warm-up: per-step caches, compilation
    tables = build_page_tables(plan, sel, table, layout)
    ex(query, pk, pv, tables, plan, D**-0.5, out)
    torch.cuda.synchronize()
    with no_sync():
        sel = selector(query, pk, table, layout, plan, meta)
        tables = build_page_tables(plan, sel, table, layout)
        ex(query, pk, pv, tables, plan, D**-0.5, out)
    want = torch.empty_like(query)
    reference_executor(query, pk, pv, tables, plan, D**-0.5, want)
    assert len(set(tables.counts.tolist())) > 1  # variable rows
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_executor_split_and_no_split_agree(group):
    reqs = [(1, 20000), (1, 300), (33, 5000)]
    hq = HKV * group
    cache, table, layout, _, qsl, _ = _batch(reqs, seed=group)
    query = torch.randn(qsl[-1], hq, D, device=DEV, generator=rng(group)).bfloat16()
    policy = LayerPolicy(True, Budget(), 16, 256, 0)  # dense rows: every page
    plan = plan_step(policy, N, qsl, [s for _, s in reqs])
    from vllm_sparse.selectors.base import empty_selection

    tables = build_page_tables(plan, empty_selection(plan, HKV, DEV), table, layout)
    pk, pv = layout.page_keys(cache), layout.page_values(cache)
    a, b, want = (torch.empty_like(query) for _ in range(3))
    TritonPagedExecutor(num_sms=1)(query, pk, pv, tables, plan, D**-0.5, a)
    ex = TritonPagedExecutor(num_sms=132)
    ex(query, pk, pv, tables, plan, D**-0.5, b)
    assert ex.work_plan(plan, HKV, group, torch.device(DEV)).splits > 1
    reference_executor(query, pk, pv, tables, plan, D**-0.5, want)
    torch.testing.assert_close(a.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(b.float(), want.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# Decode batching: one launch for the step's decode requests, same pages as one request at a time
# ---------------------------------------------------------------------------------------------

MIXED = [(1, 8000 + 517 * i) for i in range(12)] + [(300, 9000), (1, 2000)]  # + a chunk, a dense decode


def _same_sets(got, want, rows):
    """Rows whose selected page sets differ (ties aside: floating-point near-ties may flip a page)."""
    bad = []
    for row in rows:
        k, kw = int(got.counts[row]), int(want.counts[row])
        if set(got.indices[row, :k].tolist()) != set(want.indices[row, :kw].tolist()):
            bad.append(row)
    return bad


@pytest.mark.parametrize("method", ["max", "sum", "union", "twilight"])
def test_decode_batch_selects_like_per_request_without_sync(method):
    cache, table, layout, meta, qsl, query = _batch(MIXED, seed=5)
    policy = LayerPolicy(False, Budget(fraction=0.125, min_tokens=0, max_tokens=None), 16, 256, 4096, 0.25)
    plan = plan_step(policy, N, qsl, [s for _, s in MIXED])
    assert sum(r.sparse and r.query_len == 1 for r in plan.requests) == 12 and not plan.requests[-1].sparse

    def make(batched):
        base = QuestSelector("max" if method == "twilight" else method, D**-0.5, batch_decode=batched)
        return TwilightSelector(base, 0.95, D**-0.5, batch_decode=batched) if method == "twilight" else base

    pk = layout.page_keys(cache)
    want = make(False)(query, pk, table, layout, plan, meta)
    selector = make(True)
    selector(query, pk, table, layout, plan, meta)  # warm-up: per-step caches, compilation
    torch.cuda.synchronize()
    with no_sync():
        got = selector(query, pk, table, layout, plan, meta)
    rows = [r * HKV + h for r, req in enumerate(plan.requests) if req.sparse for h in range(HKV)]
    if method != "twilight":
        assert torch.equal(got.counts, want.counts)
        assert _same_sets(got, want, rows) == []
    else:  # top-p on float32 masses summed in another order: allow a rare boundary flip
        assert len(_same_sets(got, want, rows)) <= max(1, len(rows) // 50)
        assert (got.counts - want.counts).abs().max() <= 1
