"""Selected decode rows through vLLM's FlashAttention 3 (``backend.sparse_decode_rows``) on the head-major cache: equal
to the torch twin (``decode_attention_reference``) and to the Triton decode kernel these rows take by default, for
Quest columns (sink, selected pages, local window; short rows dense; padding rows) with a random selection of exactly
``SELECT`` pages (or, as Twilight's top-p, a prefix of it counted on the device), the 1.5B's and Llama's head counts,
both page sizes and metadata slots; and in a CUDA graph captured
once and replayed with other lengths, tables, selections and keys after the builder's plan for each step, with no host
sync in the replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_skip import no_sync, require_cuda

require_cuda()

from vllm_sparse.backend.dense_prefill import flash_attn_version  # noqa: E402
from vllm_sparse.backend.sparse_decode_rows import SparseDecodeRows, run_sparse_rows  # noqa: E402
from vllm_sparse.config import SparseConfig  # noqa: E402
from vllm_sparse.decode_step import DecodeColumns  # noqa: E402
from vllm_sparse.kernels.decode_attention import decode_attention_reference, decode_attention_triton  # noqa: E402
from vllm_sparse.layout import PageLayout  # noqa: E402
from vllm_sparse.policy import HEAD, SELECT, TAIL  # noqa: E402

DEV = "cuda"
D = 128
MAX_LEN = 8192


def _fa3(page: int) -> None:
    if flash_attn_version(D, page) != 3:
        pytest.skip("no FlashAttention 3 in this vLLM build for this GPU")


class Case:
    """Static buffers of one decode block (a graph reads them at fixed addresses) and the builder's planners."""

    def __init__(
        self, hq: int, hkv: int, page: int, batch: int, meta_slots: int = 0, num_blocks: int = 2000,
        device_counts: bool = False,
    ):  # fmt: skip
        self.hq, self.hkv, self.page, self.batch, self.device_counts = hq, hkv, page, batch, device_counts
        self.policy = SparseConfig(method="quest", sink_tokens=16, local_tokens=128, dense_below_tokens=300,
                                   budget={"fraction": 0.125, "min_tokens": 0}).for_layer(3)  # fmt: skip
        self.cache = torch.randn(num_blocks, hkv + meta_slots, page, 2 * D, device=DEV).bfloat16()
        self.layout = PageLayout.of(self.cache, hkv, "interleaved")
        self.page_keys, self.page_values = self.layout.page_keys(self.cache), self.layout.page_values(self.cache)
        self.block_table = torch.zeros(batch, MAX_LEN // page + 1, dtype=torch.int32, device=DEV)
        self.columns = DecodeColumns([self.policy], page, 16, MAX_LEN, torch.device(DEV), num_kv_heads=hkv)
        cap = self.columns.select_caps[self.policy]
        self.pages = torch.zeros(batch * hkv, cap, dtype=torch.int32, device=DEV)
        self.counts = torch.zeros(batch * hkv, dtype=torch.int32, device=DEV)
        self.query = torch.zeros(batch, hq, D, device=DEV, dtype=torch.bfloat16)
        self.out = torch.zeros_like(self.query)
        self.rows = SparseDecodeRows([self.policy], hq, hkv, D, page, torch.bfloat16, max_reqs=16,
                                     max_model_len=MAX_LEN, max_graph_batch=32, max_splits=32,
                                     device=torch.device(DEV), device_counts=device_counts)  # fmt: skip

    def step(self, lens: list[int], seed: int):
        """New inputs in the static buffers and the builder's work for them: ``(DecodeStep, plan)``."""
        rng = np.random.default_rng(seed)
        nb = self.cache.shape[0]
        self.block_table.copy_(torch.from_numpy(rng.integers(1, nb, self.block_table.shape)).int())
        self.query.copy_(torch.from_numpy(rng.standard_normal(self.query.shape)).bfloat16())
        decode = self.columns.write(np.asarray(lens), self.block_table)
        cols = decode.host_columns[self.policy]
        pages = np.zeros(tuple(self.pages.shape), dtype=np.int32)
        for r in range(self.batch * self.hkv):
            c = cols[r // self.hkv]
            pages[r, : c[SELECT]] = rng.choice(np.arange(c[HEAD], c[TAIL]), c[SELECT], replace=False)
        self.pages.copy_(torch.from_numpy(pages))
        counts = np.repeat(cols[:, SELECT], self.hkv)
        if self.device_counts:  # Twilight's top-p: a prefix of the selection, at least one page where there is any
            counts = np.array([rng.integers(min(1, c), c + 1) for c in counts])
        self.counts.copy_(torch.from_numpy(counts).int())
        return decode, self.rows.plan(decode)[self.policy]

    def run(self, decode, plan) -> None:
        run_sparse_rows(plan, self.query, self.page_keys, self.page_values, self.block_table, self.pages, self.counts,
                        decode.columns[self.policy], self.layout.num_head_slots, D**-0.5, self.out)  # fmt: skip

    def check(self, decode, lens: list[int]) -> None:
        cols = decode.columns[self.policy]
        ref = decode_attention_reference(self.query, self.page_keys, self.page_values, self.block_table, self.pages,
                                         self.counts, cols, self.layout.num_head_slots, D**-0.5)  # fmt: skip
        got = self.out.float().cpu()
        live = torch.tensor(lens) > 0
        assert (got[live] - ref[live]).abs().max() < 2e-2
        tri = torch.zeros_like(self.query)
        decode_attention_triton(self.query, self.page_keys, self.page_values, self.block_table, self.pages,
                                self.counts, cols, self.layout.num_head_slots, D**-0.5, tri)  # fmt: skip
        assert torch.allclose(tri.float().cpu()[live], got[live], atol=2e-2)
        assert (decode.host_columns[self.policy][:, SELECT] > 0).any() or max(lens) < 300  # sparse rows ran


@pytest.mark.parametrize(
    "hq,hkv,page,lens,meta_slots",
    [
        (32, 8, 16, [1, 17, 4096, 300], 0),  # Llama-3.1-8B heads: a dense short row, lengths inside a page
        (12, 2, 16, [4000, 2, 0, 8000], 0),  # the 1.5B's heads, a padding row
        (12, 2, 32, [4097, 31, 3333, 1000, 0, 0], 0),  # pages of 32
        (32, 8, 16, [999, 6400], 3),  # Quest's metadata slots: the head stride is not N * 2D
        (14, 2, 16, [2048] * 16, 0),  # 7 query heads a KV head, a full batch
    ],
)
@pytest.mark.parametrize("device_counts", [False, True])
def test_sparse_rows_equal_the_twin_and_the_triton_kernel(hq, hkv, page, lens, meta_slots, device_counts):
    _fa3(page)
    case = Case(hq, hkv, page, len(lens), meta_slots, device_counts=device_counts)
    decode, plan = case.step(lens, 0)
    assert plan.num_splits == 32 and (plan.scheduler is None) == device_counts  # a batch vLLM captures
    case.run(decode, plan)
    torch.cuda.synchronize()
    case.check(decode, lens)


@pytest.mark.parametrize("hq,hkv,page,device_counts", [(32, 8, 16, False), (12, 2, 16, False), (12, 2, 32, False),
                                                       (32, 8, 16, True), (12, 2, 16, True)])  # fmt: skip
def test_a_captured_graph_replays_for_other_lengths_after_each_plan(hq, hkv, page, device_counts):
    """Captured once with a capture run's short lengths, replayed with long, short and padded batches: the builder's
    plan of each step (outside the graph) is all a replay needs (with ``device_counts``, not even that: FlashAttention
    splits the rows the kernel wrote on the device)."""
    _fa3(page)
    case = Case(hq, hkv, page, 4, device_counts=device_counts)
    decode, plan = case.step([1, 1, 1, 1], 1)
    case.run(decode, plan)  # warm-up, then capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(decode, plan)
    for i, lens in enumerate(([4000, 17, 2500, 1], [MAX_LEN, 1, 0, 0], [333, 640, 6500, 3000])):
        decode, _ = case.step(lens, 2 + i)  # the same buffers (same batch size), new contents
        with no_sync():
            graph.replay()
        torch.cuda.synchronize()
        case.check(decode, lens)
