"""Dense prefill rows through vLLM's FlashAttention on the head-major cache (metadata slots
included, so the head stride is not ``N * D``): equal to the torch twin over a grid of chunk
starts, lengths and batch mixes, and writing only the prefill rows of the step's output."""

from __future__ import annotations

import pytest
import torch
from gpu_skip import require_cuda

require_cuda()

from vllm_sparse.backend.dense_prefill import DensePrefill, DenseRows, dense_prefill_reference  # noqa: E402
from vllm_sparse.layout import PageLayout  # noqa: E402

DEV = "cuda"
HQ, HKV, D, N = 32, 8, 128, 16


def _rows(requests, token_start, max_blocks, num_blocks, g) -> DenseRows:
    """requests: (context, query_len) pairs."""
    q_lens = [q for _, q in requests]
    seq = [c + q for c, q in requests]
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in requests]).to(torch.int32)
    return DenseRows(
        token_start=token_start,
        num_tokens=sum(q_lens),
        query_start=starts.to(DEV),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=DEV),
        block_table=table.to(DEV),
        max_query_len=max(q_lens),
        max_seq_len=max(seq),
    )


@pytest.mark.parametrize(
    "requests,meta_slots",
    [
        ([(0, 300)], 0),
        ([(0, 300)], 2),
        ([(4099, 517)], 2),  # chunk starts inside a page
        ([(16, 1), (5000, 2048), (0, 33)], 1),  # a one-token row among prefills
        ([(8192, 8192)], 3),
    ],
)
def test_dense_prefill_matches_reference(requests, meta_slots):
    dense = DensePrefill.create(D, N)
    if dense is None:
        pytest.skip("vLLM ships no FlashAttention for this GPU")
    g = torch.Generator().manual_seed(sum(c + q for c, q in requests))
    max_blocks = max(-(-(c + q) // N) for c, q in requests) + 3
    num_blocks = max_blocks * len(requests) + 8
    cache = torch.randn(num_blocks, HKV + meta_slots, N, 2 * D, generator=g).to(DEV, torch.bfloat16)
    layout = PageLayout.of(cache, HKV, "interleaved")
    lead = 5  # decode rows before the prefill rows in the step's query
    rows = _rows(requests, lead, max_blocks, num_blocks, g)
    query = torch.randn(lead + rows.num_tokens, HQ, D, generator=g).to(DEV, torch.bfloat16)
    out = torch.full_like(query, 7.0)
    dense(query, layout.keys(cache), layout.values(cache), rows, D**-0.5, out)
    ref = dense_prefill_reference(query, layout.keys(cache), layout.values(cache), rows, D**-0.5)
    torch.testing.assert_close(out[lead:].float(), ref, rtol=2e-2, atol=2e-2)
    assert torch.all(out[:lead] == 7.0), "rows before token_start were written"
