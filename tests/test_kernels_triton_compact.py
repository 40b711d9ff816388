"""sparse_compact's tile block statistics Triton kernel (kernels/block_scores.py) against its torch twin
on random (never zero) inputs: chunks of several tiles with a partial last one, chunks that start
inside a block and hold blocks of their own (seen by the rows after them only), blocks past the
kernel's block group, GQA groups of 1 to 4, fp32 and bf16 queries. Without CUDA it runs through
Triton's interpreter (``TRITON_INTERPRET=1``) at small shapes; see tests/triton_interpret.py."""

from __future__ import annotations

import pytest
import torch
from triton_interpret import DEVICE, HAS_CUDA, in_process, rerun_in_fresh_process

triton = pytest.importorskip("triton", reason="triton is not installed")

from helpers import gen, randn, single_thread  # noqa: F401

from vllm_sparse.kernels.block_scores import tile_block_stats, tile_block_stats_triton

test_in_fresh_process = rerun_in_fresh_process(__file__)


@in_process
@pytest.mark.parametrize("c,first_pos,block_tokens", [(40, 100, 16), (40, 280, 32), (70, 33, 8)])
@pytest.mark.parametrize("hkv,group", [(2, 2), (1, 4), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_stats_match_twin(c, first_pos, block_tokens, hkv, group, dtype):
    g = gen(c * 100 + first_pos + hkv * 10 + group)
    d, tile = 16, 16
    nb = (first_pos + c) // block_tokens
    q = randn(c, hkv * group, d, g=g, dtype=dtype) * 2
    mean_k = randn(hkv, nb, d, g=g)
    want_m, want_s = tile_block_stats(q, mean_k, first_pos, block_tokens, d**-0.5, tile)
    got_m, got_s = tile_block_stats_triton(q.to(DEVICE), mean_k.to(DEVICE), first_pos, block_tokens, d**-0.5, tile, 8)
    assert got_m.shape == want_m.shape == (hkv, group, -(-c // tile), nb)
    unseen = torch.isinf(want_m)
    assert unseen.any() and not unseen.all(), "the chunk's own blocks: unseen by its first tiles"
    assert torch.equal(torch.isinf(got_m.cpu()), unseen)
    tol = 1e-5 if not HAS_CUDA else 2e-2
    torch.testing.assert_close(got_m.cpu()[~unseen], want_m[~unseen], atol=tol, rtol=tol)
    torch.testing.assert_close(got_s.cpu(), want_s, atol=tol * 10, rtol=tol)
