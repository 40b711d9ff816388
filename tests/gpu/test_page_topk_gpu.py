"""The one-launch split top-k (``kernels.page_topk._split_fused_kernel``) on a GPU: its chunk programs
meet at barriers, so Triton's interpreter cannot run it and only a GPU tests it. It picks the pages
the torch twin picks (ties included) at every chunk count a grid allows, leaves its row counters at
zero for the next call, and gives the same pages again and again from one captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from gpu_skip import no_sync, require_cuda

require_cuda()

from vllm_sparse.kernels.page_topk import select_top_pages_reference, select_top_pages_triton  # noqa: E402
from vllm_sparse.policy import HEAD, NUM_COLUMNS, SELECT, TAIL  # noqa: E402

HKV = 8


def _columns(rows: list[tuple[int, int, int]], pages: int) -> torch.Tensor:
    cols = torch.zeros(len(rows), NUM_COLUMNS, dtype=torch.int32)
    for i, (k, lo, hi) in enumerate(rows):
        cols[i, SELECT], cols[i, HEAD], cols[i, TAIL] = k, lo, hi
    cols[:, 5] = pages
    return cols


def _scores(kind: str, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    if kind == "ties":  # long runs of ties at the k-th score
        return torch.randint(-3, 4, shape, generator=g).float() * 0.5 + 0.25
    if kind == "low_bits":  # keys differing only in their lowest digit
        return 1.0 + torch.randint(0, 64, shape, generator=g).float() * 2.0**-23
    return torch.randn(shape, generator=g) * 3  # continuous, both signs


def _check(got, counts, want, want_counts):
    assert torch.equal(counts.cpu(), want_counts)
    for r in range(want.shape[0]):
        k = int(want_counts[r])
        assert sorted(got[r, :k].cpu().tolist()) == want[r, :k].tolist(), r


@pytest.mark.parametrize("kind", ["continuous", "ties", "low_bits"])
@pytest.mark.parametrize("chunks", [1, 2, 5, 16])
def test_fused_matches_the_twin(kind, chunks):
    """One request (8 rows) per call, so that 16 chunks still fit any H100 at once: 1 page, 991
    (12.5% of 128K), every selectable page but one, every page, none, a short range."""
    pages = 8449  # a 132K row of pages of 16
    g = torch.Generator().manual_seed(chunks)
    n = pages - 40
    counters = torch.zeros(2 * HKV, dtype=torch.int32, device="cuda")  # as DecodeStep.topk_counters
    for spec in [(991, 1, n), (0, 0, 0), (1, 7, 3000), (n - 2, 1, n), (n - 1, 1, n), (300, 100, 400)]:
        cols = _columns([spec], pages)
        scores = _scores(kind, (HKV, pages), g)
        want = select_top_pages_reference(scores, cols, HKV, pages)
        scores_d, cols_d = scores.cuda(), cols.cuda()
        with no_sync():
            got = select_top_pages_triton(scores_d, cols_d, HKV, pages, chunks=chunks, fused=True, counters=counters)
        _check(*got, *want)
        assert int(counters.abs().sum()) == 0, spec
    fresh = select_top_pages_triton(scores_d, cols_d, HKV, pages, chunks=chunks, fused=True)  # its own zeros
    _check(*fresh, *want)


def test_fused_replays_from_a_graph():
    """Captured once, replayed with new scores and columns: the counters reset themselves."""
    pages, rows_spec = 4000, [(400, 2, 3900), (17, 0, 1000), (0, 0, 0), (3000, 10, 3990)]
    g = torch.Generator().manual_seed(0)
    cols = _columns(rows_spec, pages).cuda()
    scores = torch.randn(len(rows_spec) * HKV, pages, generator=g).cuda()
    counters = torch.zeros(2 * scores.shape[0], dtype=torch.int32, device="cuda")
    out = {}

    def call():
        out["sel"] = select_top_pages_triton(scores, cols, HKV, 3000, chunks=4, fused=True, counters=counters)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for i in range(20):
        scores.copy_(torch.randn(scores.shape, generator=g))
        new_cols = _columns([(400 - i, 2, 3900), (17 + i, i, 1000), (i % 2, 0, 500), (2900, 10, 3990)], pages)
        cols.copy_(new_cols)
        graph.replay()
        want = select_top_pages_reference(scores.cpu(), new_cols, HKV, 3000)
        _check(*out["sel"], *want)
        assert int(counters.abs().sum()) == 0, i
