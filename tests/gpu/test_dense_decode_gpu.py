"""Dense decode rows through vLLM's FlashAttention 3 (``backend.dense_decode``) on the head-major cache: equal to the
torch twin (``decode_attention_reference`` with dense columns) and to the Triton decode kernel these rows took before,
over batch sizes, lengths that end inside a page, padding rows (length 0), metadata slots, the 1.5B's and Llama's
head counts and both page sizes; and in a CUDA graph captured once and replayed with other lengths, block tables and
keys after the builder's plan for them, as vLLM's full decode graphs replay it, with no host sync in the replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_skip import no_sync, require_cuda

require_cuda()

from vllm_sparse.backend.dense_decode import DenseDecode, run_dense_decode  # noqa: E402
from vllm_sparse.backend.dense_prefill import flash_attn_version  # noqa: E402
from vllm_sparse.kernels.decode_attention import decode_attention_reference, decode_attention_triton  # noqa: E402
from vllm_sparse.layout import PageLayout  # noqa: E402
from vllm_sparse.policy import LAST, NUM_COLUMNS, TOTAL  # noqa: E402

DEV = "cuda"
D = 128
MAX_BLOCKS = 256


def _fa3(page: int) -> None:
    if flash_attn_version(D, page) != 3:
        pytest.skip("no FlashAttention 3 in this vLLM build for this GPU")


def _dense_columns(lens: list[int], page: int) -> torch.Tensor:
    """``int32 [B, NUM_COLUMNS]`` decode columns of dense rows: every page (``HEAD = TAIL = 0``), lengths ``lens``."""
    n = np.asarray(lens)
    total = -(-n // page)
    cols = torch.zeros(len(lens), NUM_COLUMNS, dtype=torch.int32)
    cols[:, TOTAL] = torch.from_numpy(total).int()
    cols[:, LAST] = torch.from_numpy(np.where(n > 0, n - (total - 1) * page, 0)).int()
    return cols


class Case:
    """Static buffers of one decode block: the graph reads them at fixed addresses."""

    def __init__(self, hq: int, hkv: int, page: int, batch: int, meta_slots: int = 0, num_blocks: int = 600):
        self.hq, self.hkv, self.page, self.batch = hq, hkv, page, batch
        self.cache = torch.randn(num_blocks, hkv + meta_slots, page, 2 * D, device=DEV).bfloat16()
        self.layout = PageLayout.of(self.cache, hkv, "interleaved")
        self.keys, self.values = self.layout.keys(self.cache), self.layout.values(self.cache)
        self.block_table = torch.zeros(batch, MAX_BLOCKS, dtype=torch.int32, device=DEV)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=DEV)
        self.query = torch.zeros(batch, hq, D, device=DEV, dtype=torch.bfloat16)
        self.out = torch.zeros_like(self.query)
        self.planner = DenseDecode(hq, hkv, D, page, torch.bfloat16, max_reqs=16, max_graph_batch=32, max_splits=32,
                                   device=torch.device(DEV))  # fmt: skip

    def set_inputs(self, lens: list[int], g: torch.Generator) -> None:
        nb = self.cache.shape[0]
        self.block_table.copy_(torch.randint(1, nb, self.block_table.shape, device=DEV, generator=g).int())
        self.query.copy_(torch.randn(self.query.shape, device=DEV, generator=g).bfloat16())
        self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))

    def reference(self, lens: list[int]) -> torch.Tensor:
        """The twin over dense columns: every page of every row (padding rows: zeros)."""
        cols = _dense_columns(lens, self.page)
        rows = self.batch * self.hkv
        return decode_attention_reference(
            self.query, self.layout.page_keys(self.cache), self.layout.page_values(self.cache), self.block_table,
            torch.zeros(rows, 1, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32), cols,
            self.layout.num_head_slots, D**-0.5,
        )  # fmt: skip

    def triton(self, lens: list[int]) -> torch.Tensor:
        """The Triton decode kernel over the same dense rows (what these rows ran before)."""
        ref_cols = _dense_columns(lens, self.page)
        rows = self.batch * self.hkv
        out = torch.zeros_like(self.query)
        decode_attention_triton(
            self.query, self.layout.page_keys(self.cache), self.layout.page_values(self.cache), self.block_table,
            torch.zeros(rows, 1, dtype=torch.int32, device=DEV), torch.zeros(rows, dtype=torch.int32, device=DEV),
            ref_cols.to(DEV), self.layout.num_head_slots, D**-0.5, out,
        )  # fmt: skip
        return out

    def run(self, plan) -> None:
        run_dense_decode(plan, self.query, self.keys, self.values, self.block_table, D**-0.5, self.out)


def _check(case: Case, lens: list[int]) -> None:
    ref = case.reference(lens)
    got = case.out.float().cpu()
    assert (got - ref).abs().max() < 2e-2
    live = torch.tensor(lens) > 0
    assert torch.allclose(case.triton(lens).float().cpu()[live], got[live], atol=2e-2)


@pytest.mark.parametrize(
    "hq,hkv,page,lens,meta_slots",
    [
        (32, 8, 16, [1, 17, 4096, 300], 0),  # Llama-3.1-8B heads, a length of one, lengths inside a page
        (12, 2, 16, [4000, 2, 0, 16], 0),  # the 1.5B's heads, a padding row
        (12, 2, 32, [4097, 31, 33, 1000, 0, 0], 0),  # pages of 32
        (32, 8, 16, [999, 64], 2),  # metadata slots: the head stride is not N * 2D
        (14, 2, 16, [2048] * 16, 0),  # 7 query heads a KV head, a full batch
    ],
)
def test_dense_decode_equals_the_twin_and_the_triton_kernel(hq, hkv, page, lens, meta_slots):
    _fa3(page)
    g = torch.Generator(device=DEV).manual_seed(0)
    case = Case(hq, hkv, page, len(lens), meta_slots)
    case.set_inputs(lens, g)
    plan = case.planner.plan(case.seq_lens, max(lens))
    assert plan.num_splits == 32 and plan.scheduler is not None  # a batch vLLM captures
    case.run(plan)
    torch.cuda.synchronize()
    _check(case, lens)


def test_batches_past_the_captured_sizes_let_flashattention_split_on_its_own():
    _fa3(16)
    case = Case(32, 8, 16, 4)
    case.planner.max_graph_batch = 2
    g = torch.Generator(device=DEV).manual_seed(1)
    lens = [100, 2000, 3000, 1]
    case.set_inputs(lens, g)
    plan = case.planner.plan(case.seq_lens, max(lens))
    assert plan.num_splits == 0
    case.run(plan)
    torch.cuda.synchronize()
    _check(case, lens)


@pytest.mark.parametrize("hq,hkv,page", [(32, 8, 16), (12, 2, 16), (12, 2, 32)])
def test_a_captured_graph_replays_for_other_lengths_after_each_plan(hq, hkv, page):
    """Captured once (with the short lengths of a capture run), replayed with long, short and padded batches: the
    builder's plan of each step (outside the graph) is all a replay needs."""
    _fa3(page)
    g = torch.Generator(device=DEV).manual_seed(2)
    case = Case(hq, hkv, page, 4)
    case.set_inputs([1, 1, 1, 1], g)
    plan = case.planner.plan(case.seq_lens, 1)
    case.run(plan)  # warm-up, then capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(plan)
    for lens in ([4000, 17, 2500, 1], [page * MAX_BLOCKS, 1, 0, 0], [33, 64, 65, 3000]):
        case.set_inputs(lens, g)
        case.planner.plan(case.seq_lens, max(lens))  # the builder's work for the step, into the same buffers
        with no_sync():
            graph.replay()
        torch.cuda.synchronize()
        _check(case, lens)
