"""vLLM's FlashAttention over (request, KV head) rows vs the torch reference executor (the oracle).

Random head-major caches with a metadata slot, random block tables, bf16; dense plans, random
sparse selections and counts that vary per row on the device (Twilight's case); mixed steps with
chunks starting inside a page, one-token rows and decode rows before the planned requests; and a
planned step reused by later layers under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_skip import no_sync, require_cuda

require_cuda()

from helpers import gen, random_block_table, random_selection  # noqa: E402

from vllm_sparse.backend.flash_rows import FlashRowsExecutor  # noqa: E402
from vllm_sparse.config import Budget, LayerPolicy  # noqa: E402
from vllm_sparse.executors.reference import reference_executor  # noqa: E402
from vllm_sparse.layout import PageLayout  # noqa: E402
from vllm_sparse.policy import plan_step  # noqa: E402
from vllm_sparse.selectors.base import Selection, empty_selection  # noqa: E402
from vllm_sparse.tables import build_page_tables  # noqa: E402

DEV = torch.device("cuda")
N, D = 16, 128
DENSE = LayerPolicy(True, Budget(), 16, 512, 4096)
SPARSE = LayerPolicy(False, Budget(fraction=0.3, min_tokens=0, max_tokens=None), 16, 32, 0)
MIXED = [(13, 297), (1, 283), (9, 9), (16, 272), (1, 530), (20, 452), (300, 1333), (2048, 6000)]
LEAD = 4  # decode rows of the step before the planned requests


@pytest.fixture(scope="module")
def executor():
    ex = FlashRowsExecutor.create(D, N)
    if ex is None:
        pytest.skip("vLLM ships no FlashAttention with paged KV for this GPU")
    return ex


def _setup(policy, hkv, group, seed, case):
    g = gen(seed)
    seq_lens = [s for _, s in MIXED]
    qsl = [LEAD]
    for ql, _ in MIXED:
        qsl.append(qsl[-1] + ql)
    table, num_blocks = random_block_table(seq_lens, N, g)
    cache = (torch.randn(num_blocks, hkv + 1, N, 2 * D, generator=g) * 2).to(DEV, torch.bfloat16)
    layout = PageLayout.of(cache, hkv, "interleaved")
    plan = plan_step(policy, N, qsl, seq_lens)
    if case == "dense":
        sel = empty_selection(plan, hkv, DEV)
    else:
        sel, _ = random_selection(plan, hkv, g)
        counts = sel.counts
        if case == "varying":
            counts = (counts - torch.arange(counts.numel()) % 5).clamp(min=0).int()
        sel = Selection(sel.indices.to(DEV), counts.to(DEV))
    tables = build_page_tables(plan, sel, table.to(DEV), layout)
    query = torch.randn(qsl[-1], hkv * group, D, generator=g).to(DEV, torch.bfloat16)
    return layout, cache, plan, tables, query


@pytest.mark.parametrize("group", [4, 7])
@pytest.mark.parametrize("hkv", [1, 8])
@pytest.mark.parametrize("case", ["dense", "sparse", "varying"])
def test_matches_reference(executor, group, hkv, case):
    layout, cache, plan, tables, query = _setup(DENSE if case == "dense" else SPARSE, hkv, group, group + hkv, case)
    pk, pv = layout.page_keys(cache), layout.page_values(cache)
    got = torch.full_like(query, float("nan"))
    executor(query, pk, pv, tables, plan, D**-0.5, got)
    want = torch.full_like(query, float("nan"))
    reference_executor(query, pk, pv, tables, plan, D**-0.5, want)
    assert got[:LEAD].isnan().all(), "decode rows before the plan were written"
    torch.testing.assert_close(got[LEAD:].float(), want[LEAD:].float(), rtol=2e-2, atol=2e-2)


def test_later_layers_run_without_sync(executor):
    hkv, group = 2, 4
    layout, cache, plan, tables, query = _setup(SPARSE, hkv, group, 11, "varying")
    pk, pv = layout.page_keys(cache), layout.page_values(cache)
    executor.prepare(plan, hkv, group, D, query.dtype, cache.dtype, D**-0.5, DEV)  # the builder's part
    for layer in range(3):
        q = torch.randn_like(query) * (1 + layer)
        got = torch.empty_like(q)
        torch.cuda.synchronize()
        with no_sync():
            executor(q, pk, pv, tables, plan, D**-0.5, got)
        want = torch.empty_like(q)
        reference_executor(q, pk, pv, tables, plan, D**-0.5, want)
        torch.testing.assert_close(got[LEAD:].float(), want[LEAD:].float(), rtol=2e-2, atol=2e-2)
