"""The device-driven decode path (CUDA-graph safe): its Triton kernels against their torch twins and
against the host-planned per-request pipeline, at small shapes.

Without CUDA the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``); with CUDA
compiled. Every length the kernels use comes from the decode columns on the device.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from triton_interpret import DEVICE, in_process, rerun_in_fresh_process

triton = pytest.importorskip("triton", reason="triton is not installed")

from helpers import brute_attention, gen, make_paged_batch, randn, single_thread  # noqa: F401  (autouse fixture)

from vllm_sparse.config import SparseConfig
from vllm_sparse.decode_step import DecodeColumns
from vllm_sparse.kernels.decode_attention import decode_attention_reference, decode_attention_triton
from vllm_sparse.kernels.page_topk import select_top_pages_reference, select_top_pages_triton
from vllm_sparse.kernels.quest_rows import QuestRows
from vllm_sparse.kernels.quest_score import quest_decode_bounds_triton
from vllm_sparse.kernels.quoka_score import quoka_decode_scores_triton
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.int4_shadow import write_int4_shadow
from vllm_sparse.metadata.minmax_int8 import decode_minmax_int8, encode_minmax_int8
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.policy import HEAD, NUM_COLUMNS, SELECT, TAIL, plan_step
from vllm_sparse.selectors import make_selector
from vllm_sparse.selectors.quest import page_upper_bounds
from vllm_sparse.selectors.quoka import group_query, score_pages

test_in_fresh_process = rerun_in_fresh_process(__file__)

N, D, HKV, G = 4, 32, 2, 3
BUDGET = {"fraction": 0.25, "min_tokens": 8, "max_tokens": None}


def _columns(rows: list[tuple[int, int, int]], pages: int) -> torch.Tensor:
    """Decode columns with given (select, head, tail) and PAST = pages."""
    cols = torch.zeros(len(rows), NUM_COLUMNS, dtype=torch.int32)
    for i, (k, lo, hi) in enumerate(rows):
        cols[i, SELECT], cols[i, HEAD], cols[i, TAIL] = k, lo, hi
    cols[:, 5] = pages
    return cols


@in_process
@pytest.mark.parametrize("pages", [7, 40, 2500, 9000])  # 9000: more than the kernel keeps in registers
@pytest.mark.parametrize("chunks", [None, 4])  # 4: a chunk of 9000 pages takes three tiles
def test_select_top_pages_matches_topk(pages, chunks):
    g = gen(pages)
    rows_spec = [(3, 1, pages - 2), (0, 0, 0), (min(5, pages - 4), 2, pages - 1), (pages - 3, 1, pages - 2)]
    cols = _columns(rows_spec, pages)
    scores = randn(len(rows_spec) * HKV, pages + 3, g=g) * 4 - 1  # negative and positive scores
    got, counts = select_top_pages_triton(scores.to(DEVICE), cols.to(DEVICE), HKV, pages, chunks=chunks)
    want, want_counts = select_top_pages_reference(scores, cols, HKV, pages)
    assert torch.equal(counts.cpu(), want_counts)
    for r in range(scores.shape[0]):
        k = int(want_counts[r])
        assert sorted(got[r, :k].cpu().tolist()) == want[r, :k].tolist(), r


@in_process
@pytest.mark.parametrize("stop_after", [1, 2, 3])
@pytest.mark.parametrize("chunks", [None, 3])
def test_select_top_pages_stops_at_the_first_digit_that_settles_it(stop_after, chunks):
    """Positive scores built key by key: every page shares the first ``stop_after - 1`` 8-bit digits,
    the k best have a larger digit ``stop_after`` than the others and random bits below it. The radix
    search stops at that digit and the last pass compares keys by the digits above the random bits:
    still exactly the k best pages."""
    pages, k = 600, 37
    g = gen(stop_after)
    shift = 32 - 8 * stop_after  # the bits below the deciding digit
    prefix = 0x3FC00000 & ~((1 << (shift + 8)) - 1)  # the digits every page shares (1.5's)
    lo_digit, best_digit = (0x38, 0x40) if stop_after == 1 else (0, 0xF0)  # positive, finite floats
    digits = torch.randint(lo_digit, best_digit, (HKV, pages), generator=g, dtype=torch.int64)
    perm = torch.stack([torch.randperm(pages - 4, generator=g)[:k] + 2 for _ in range(HKV)])
    digits.scatter_(1, perm, best_digit)
    lower = torch.randint(0, 1 << shift, (HKV, pages), generator=g, dtype=torch.int64)
    scores = (prefix | (digits << shift) | lower).to(torch.int32).view(torch.float32)
    cols = _columns([(k, 2, pages - 2)], pages)
    got, counts = select_top_pages_triton(scores.to(DEVICE), cols.to(DEVICE), HKV, pages, chunks=chunks)
    want, want_counts = select_top_pages_reference(scores, cols, HKV, pages)
    assert torch.equal(counts.cpu(), want_counts)
    for r in range(HKV):
        assert sorted(got[r, :k].cpu().tolist()) == want[r, :k].tolist() == sorted(perm[r].tolist()), r


@in_process
def test_select_top_pages_ties_keep_the_count():
    """Tied scores at the k-th place: exactly k distinct pages, all at least the k-th score."""
    pages = 50
    scores = torch.zeros(HKV, pages)
    scores[:, 10:20] = 2.0  # 10 pages above
    scores[:, 30:45] = 1.0  # 15 tied at the threshold
    cols = _columns([(17, 1, 48)], pages)
    got, counts = select_top_pages_triton(scores.to(DEVICE), cols.to(DEVICE), HKV, 32)
    for r in range(HKV):
        picked = got[r, :17].cpu().tolist()
        assert int(counts[r]) == 17 and len(set(picked)) == 17
        assert set(range(10, 20)) <= set(picked) and all(30 <= p < 45 for p in picked if not 10 <= p < 20)


SCORE_KINDS = ["ties", "all_equal", "negative", "low_bits", "wide"]


def _score_rows(kind: str, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Random non-zero scores of a kind that stresses the radix select."""
    if kind == "ties":  # few distinct values: long runs of ties at the k-th score
        return torch.randint(-3, 4, shape, generator=g).float() * 0.5 + 0.25
    if kind == "all_equal":
        return torch.full(shape, -1.5)
    if kind == "negative":
        return -(torch.rand(shape, generator=g) + 0.1) * 100
    if kind == "low_bits":  # keys that differ only in their lowest digit
        return 1.0 + torch.randint(0, 64, shape, generator=g).float() * 2.0**-23
    return randn(*shape, g=g) * 10.0 ** torch.randint(-30, 30, shape, generator=g).float()  # "wide"


@in_process
@pytest.mark.parametrize("pages", [9, 300, 2600, 5000])
@pytest.mark.parametrize(
    "kind, chunks",
    [(k, c) for c in (None, 3) for k in SCORE_KINDS] + [("ties", 16), ("all_equal", 16), ("ties", 1), ("wide", 1)],
)
def test_select_top_pages_exact_with_ties(kind, pages, chunks):
    """The k largest pages exactly, ties at the k-th score going to the lower pages: k = 1,
    k = selectable - 1, every page, no page, a row of no selectable pages, and long rows (5000 pages
    take the widest tile); one program a row (``None``: the interpreter's rule; 1: also for the long
    rows, whose scores do not fit one tile of registers) or the row split over ``chunks`` programs
    (16 chunks of a 9-page row leave most of them empty)."""
    n = pages - 3  # selectable pages [1, pages - 2)
    rows_spec = [(1, 1, pages - 2), (n - 1, 1, pages - 2), (n, 1, pages - 2), (0, 1, pages - 2), (0, 4, 4),
                 (n // 3, 1, pages - 2), (n // 2, 0, pages)]  # fmt: skip
    cols = _columns(rows_spec, pages)
    scores = _score_rows(kind, (len(rows_spec) * HKV, pages), gen(pages))
    got, counts = select_top_pages_triton(scores.to(DEVICE), cols.to(DEVICE), HKV, pages, chunks=chunks)
    want, want_counts = select_top_pages_reference(scores, cols, HKV, pages)
    assert torch.equal(counts.cpu(), want_counts)
    for r in range(scores.shape[0]):
        k = int(want_counts[r])
        assert sorted(got[r, :k].cpu().tolist()) == want[r, :k].tolist(), (r, rows_spec[r // HKV])


@in_process
@pytest.mark.parametrize("kind", ["ties", "low_bits", "wide"])
def test_select_top_pages_one_launch_kernel(kind):
    """The one-launch split kernel (``fused``) with one chunk per row, the only grid Triton's
    interpreter can run (its programs run one after another, so chunks waiting on each other never
    meet): the same pages as the twin, and its row counters left at zero for the next launch.
    Chunks meeting at barriers are tested on a GPU (``tests/gpu/test_page_topk_gpu.py``)."""
    pages = 700
    n = pages - 3
    rows_spec = [(1, 1, pages - 2), (n - 1, 1, pages - 2), (n, 1, pages - 2), (0, 4, 4), (n // 3, 1, pages - 2)]
    cols = _columns(rows_spec, pages)
    scores = _score_rows(kind, (len(rows_spec) * HKV, pages), gen(pages))
    counters = torch.zeros(2 * scores.shape[0], dtype=torch.int32, device=DEVICE)
    got, counts = select_top_pages_triton(
        scores.to(DEVICE), cols.to(DEVICE), HKV, pages, chunks=1, fused=True, counters=counters
    )
    want, want_counts = select_top_pages_reference(scores, cols, HKV, pages)
    assert torch.equal(counts.cpu(), want_counts)
    for r in range(scores.shape[0]):
        k = int(want_counts[r])
        assert sorted(got[r, :k].cpu().tolist()) == want[r, :k].tolist(), (r, rows_spec[r // HKV])
    assert int(counters.abs().sum()) == 0


def _cache(seq_lens, order="interleaved", dtype=torch.float32, seed=0, meta_slots=0):
    return make_paged_batch(seq_lens, HKV, N, D, order=order, meta_slots=meta_slots, dtype=dtype, seed=seed)


@in_process
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_reference_and_brute_force(splits, dtype):
    seq_lens = [37, 9, 64, 1, 0]  # a padding row (0) attends nothing
    g = gen(7)
    batch = _cache([max(s, 1) for s in seq_lens], dtype=dtype, seed=3)
    layout = PageLayout.of(batch.kv_cache, HKV, "interleaved")
    policy = SparseConfig(method="quest", dense_below_tokens=0, sink_tokens=4, local_tokens=4,
                          budget={"fraction": 0.5, "min_tokens": 4, "max_tokens": None}).for_layer(1)  # fmt: skip
    cols = torch.from_numpy(DecodeColumns([policy], N, 8, 64, "cpu").write(np.array(seq_lens), batch.block_table)
                            .host_columns[policy])  # fmt: skip
    # a random selection among each row's selectable pages
    rows = len(seq_lens) * HKV
    pages = torch.zeros(rows, 8, dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    for r in range(rows):
        k, lo, hi = (int(cols[r // HKV, c]) for c in (SELECT, HEAD, TAIL))
        perm = torch.randperm(hi - lo, generator=g)[:k] + lo
        pages[r, :k] = perm.int()
        counts[r] = k
    query = randn(len(seq_lens), HKV * G, D, g=g, dtype=dtype)
    args = (layout.page_keys(batch.kv_cache), layout.page_values(batch.kv_cache), batch.block_table, pages, counts)
    want = decode_attention_reference(query, *args, cols, layout.num_head_slots, D**-0.5)
    out = torch.full_like(query, float("nan"), device=DEVICE)
    dev = [a.to(DEVICE) for a in args]
    decode_attention_triton(query.to(DEVICE), *dev, cols.to(DEVICE), layout.num_head_slots, D**-0.5, out, splits)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.cpu().float(), want, rtol=tol, atol=tol)
    # against true positions: each row sees its selected and forced pages, every token of them
    for b, s in enumerate(seq_lens):
        if s == 0:
            assert torch.equal(out[b].cpu().float(), torch.zeros(HKV * G, D))
            continue
        lo, hi, total = int(cols[b, HEAD]), int(cols[b, TAIL]), int(cols[b, 3])
        visible = [
            set(pages[b * HKV + h, : int(counts[b * HKV + h])].tolist()) | set(range(lo)) | set(range(hi, total))
            for h in range(HKV)
        ]
        ref = brute_attention(query[b : b + 1], batch.keys[b], batch.values[b], s - 1, D**-0.5, visible, N)
        torch.testing.assert_close(out[b : b + 1].cpu().double(), ref, rtol=3 * tol, atol=3 * tol)


@in_process
@pytest.mark.parametrize("splits", [40, 128])
def test_decode_attention_many_splits(splits):
    """More splits than the merge reads at once (32): the first row attends 2315 tokens, 37 shares
    of 64 tokens for both split counts (the other splits are empty)."""
    seq_lens = [64 * 40 + 7, 900, 0]
    g = gen(17)
    batch = _cache([max(s, 1) for s in seq_lens], seed=4)
    layout = PageLayout.of(batch.kv_cache, HKV, "interleaved")
    policy = SparseConfig(method="quest", dense_below_tokens=0, sink_tokens=4, local_tokens=64,
                          budget={"fraction": 0.9, "min_tokens": 4, "max_tokens": None}).for_layer(1)  # fmt: skip
    cols = torch.from_numpy(DecodeColumns([policy], N, 8, 4096, "cpu").write(np.array(seq_lens), batch.block_table)
                            .host_columns[policy])  # fmt: skip
    rows = len(seq_lens) * HKV
    width = int(cols[:, SELECT].max())
    pages = torch.zeros(rows, width, dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    for r in range(rows):
        k, lo, hi = (int(cols[r // HKV, c]) for c in (SELECT, HEAD, TAIL))
        pages[r, :k] = (torch.randperm(hi - lo, generator=g)[:k] + lo).int()
        counts[r] = k
    query = randn(len(seq_lens), HKV * G, D, g=g) * 2
    args = (layout.page_keys(batch.kv_cache), layout.page_values(batch.kv_cache), batch.block_table, pages, counts)
    want = decode_attention_reference(query, *args, cols, layout.num_head_slots, D**-0.5)
    out = torch.full_like(query, float("nan"), device=DEVICE)
    dev = [a.to(DEVICE) for a in args]
    decode_attention_triton(query.to(DEVICE), *dev, cols.to(DEVICE), layout.num_head_slots, D**-0.5, out, splits)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)


def test_num_splits_grow_at_small_batches():
    from vllm_sparse.kernels import decode_attention as da

    cpu = torch.device("cpu")  # 4 "SMs" under the interpreter
    assert da.num_splits(1, cpu) == 4 * da.PROGRAMS_PER_SM_FEW_ROWS <= da.MAX_SPLITS
    assert da.num_splits(8, cpu) == -(-4 * da.PROGRAMS_PER_SM_FEW_ROWS // 8)
    assert da.num_splits(da.FEW_ROWS, cpu) == 1  # 4 "SMs" x 4 programs over 32 rows
    assert da.num_splits(da.FEW_ROWS + 1, cpu) == -(-4 * da.PROGRAMS_PER_SM // (da.FEW_ROWS + 1)) == 1
    assert da.num_splits(1000, cpu) == 1
    assert da.PROGRAMS_PER_SM_FEW_ROWS > da.PROGRAMS_PER_SM  # few rows are long rows: more splits each


def test_few_rows_line_moves_with_its_env_var(monkeypatch):
    """``VLLM_SPARSE_DECODE_FEW_ROWS`` (read at import) moves the few-rows line; 0 gives every batch
    ``PROGRAMS_PER_SM``; a value that is not a row count fails at import, naming the variable."""
    from vllm_sparse.kernels import decode_attention as da

    assert da.few_rows({}) == da.few_rows({da.FEW_ROWS_ENV: ""}) == da.FEW_ROWS == 32  # empty: unset, as vLLM reads
    assert da.few_rows({da.FEW_ROWS_ENV: "16"}) == 16
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ValueError, match=da.FEW_ROWS_ENV):
            da.few_rows({da.FEW_ROWS_ENV: bad})
    cpu = torch.device("cpu")
    assert da.num_splits(8, cpu) == -(-da.PROGRAMS_PER_SM_FEW_ROWS * da.num_sms(cpu) // 8)
    monkeypatch.setattr(da, "FEW_ROWS", da.few_rows({da.FEW_ROWS_ENV: "0"}))
    assert da.num_splits(8, cpu) == -(-da.PROGRAMS_PER_SM * da.num_sms(cpu) // 8)


def _selectable_rows(seq_lens, policy):
    cols = DecodeColumns([policy], N, 16, 512, "cpu").write(np.array(seq_lens), torch.zeros(1, 1))
    return torch.from_numpy(cols.host_columns[policy])


def _quest_decode_case(seq_lens, seed):
    """Quest decode columns of ``seq_lens``, a paged cache and random key min/max planes and queries:
    ``(cols, batch, kmin, kmax, query)``."""
    cfg = SparseConfig(method="quest", dense_below_tokens=0, sink_tokens=4, local_tokens=8, budget=BUDGET)
    cols = _selectable_rows(seq_lens, cfg.for_layer(1))
    batch = _cache(seq_lens, meta_slots=1, seed=seed)
    g = gen(seed + 6)
    nb = batch.kv_cache.shape[0]
    a, b = randn(nb, HKV, D, g=g), randn(nb, HKV, D, g=g)
    query = randn(len(seq_lens), HKV * G, D, g=g)
    return cols, batch, torch.minimum(a, b), torch.maximum(a, b), query


@in_process
@pytest.mark.parametrize("reduce_max", [True, False])
def test_quest_decode_bounds_match_reference(reduce_max):
    seq_lens = [200, 3, 90]
    cols, batch, kmin, kmax, query = _quest_decode_case(seq_lens, seed=5)
    cap = 64
    got = quest_decode_bounds_triton(
        query.to(DEVICE), kmin.to(DEVICE), kmax.to(DEVICE), batch.block_table.to(DEVICE), cols.to(DEVICE), cap,
        reduce_max=reduce_max,
    ).cpu()  # fmt: skip
    for r in range(len(seq_lens)):
        k, lo, hi = (int(cols[r, c]) for c in (SELECT, HEAD, TAIL))
        if not k:
            continue
        blocks = batch.block_table[r, lo:hi].long()
        want = page_upper_bounds(query[r : r + 1], kmin[blocks].transpose(0, 1), kmax[blocks].transpose(0, 1))
        rows = got[r * HKV : (r + 1) * HKV, ..., lo:hi]
        torch.testing.assert_close(rows, want.amax(dim=1) if reduce_max else want, rtol=1e-4, atol=1e-4)


@in_process
def test_quest_bounds_inside_the_top_k_pick_what_bounds_then_top_k_pick():
    # rows that select some pages, none (3 tokens: dense) and, with a wide budget, every selectable page
    seq_lens = [300, 3, 90, 170]
    cols, batch, kmin, kmax, query = _quest_decode_case(seq_lens, seed=6)
    cols[3, SELECT] = cols[3, TAIL] - cols[3, HEAD]  # every selectable page
    cap, k_cap = 96, 80
    dev = [t.to(DEVICE) for t in (query, kmin, kmax, batch.block_table, cols)]
    bounds = quest_decode_bounds_triton(*dev, cap)
    want, want_counts = select_top_pages_triton(bounds, dev[4], HKV, k_cap, chunks=3)  # split over programs
    scores = torch.full((len(seq_lens) * HKV, cap), float("nan"), device=DEVICE)
    got, counts = select_top_pages_triton(scores, dev[4], HKV, k_cap, chunks=1, quest=QuestRows(*dev[:4]))
    assert torch.equal(counts.cpu(), want_counts.cpu())
    ref, _ = select_top_pages_reference(bounds.cpu(), cols, HKV, k_cap)
    for r, k in enumerate(counts.tolist()):
        assert sorted(got[r, :k].tolist()) == sorted(want[r, :k].tolist()) == ref[r, :k].tolist()
        lo, hi = (int(cols[r // HKV, c]) for c in (HEAD, TAIL))
        if 0 < k < hi - lo:  # the rows that ranked pages scored them into the workspace
            torch.testing.assert_close(scores[r, lo:hi].cpu(), bounds[r, lo:hi].cpu())
    assert sum(0 < k < 50 for k in counts.tolist()) >= 4  # some rows ranked (not every page, not none)
    with pytest.raises(AssertionError, match="one-program-a-row"):  # few long rows: the bounds kernel scores
        select_top_pages_triton(scores, dev[4], HKV, k_cap, chunks=3, quest=QuestRows(*dev[:4]))


def test_int8_minmax_codes_bound_the_planes_within_a_step():
    g = gen(11)
    a, b = randn(50, HKV, D, g=g) * 3, randn(50, HKV, D, g=g) * 3
    kmin, kmax = torch.minimum(a, b).bfloat16(), torch.maximum(a, b).bfloat16()
    kmin[0], kmax[0] = 0.0, 0.0  # an all-zero vector
    kmax[1, 0, 5] = 1000.0  # an outlier channel widens its vector's step
    lo, hi, scale = encode_minmax_int8(kmin, kmax)
    assert lo.dtype == hi.dtype == torch.int8 and scale.shape == (50, HKV)
    dlo, dhi = decode_minmax_int8(lo, scale).double(), decode_minmax_int8(hi, scale).double()
    assert (dlo <= kmin.double()).all() and (dhi >= kmax.double()).all()  # still bounds
    step = scale.double()[..., None]
    assert (kmin.double() - dlo < step * (1 + 1e-6)).all() and (dhi - kmax.double() < step * (1 + 1e-6)).all()
    assert (lo.abs() <= 127).all() and (hi.abs() <= 127).all() and torch.equal(lo[0], torch.zeros_like(lo[0]))


@in_process
@pytest.mark.parametrize("one_launch", [False, True])
def test_quest_bounds_of_int8_codes_match_the_decoded_planes(one_launch):
    seq_lens = [300, 3, 90, 170]
    cols, batch, kmin, kmax, query = _quest_decode_case(seq_lens, seed=8)
    lo, hi, scale = encode_minmax_int8(kmin, kmax)
    dlo, dhi = decode_minmax_int8(lo, scale), decode_minmax_int8(hi, scale)
    cap, k_cap = 96, 80
    dev = [t.to(DEVICE) for t in (query, lo, hi, batch.block_table, cols)]
    if one_launch:  # scored inside the one-program-a-row top-k: the pages of the bounds of the decoded planes
        scores = torch.full((len(seq_lens) * HKV, cap), float("nan"), device=DEVICE)
        quest = QuestRows(*dev[:4], scale=scale.to(DEVICE))
        got, counts = select_top_pages_triton(scores, dev[4], HKV, k_cap, chunks=1, quest=quest)
        bounds = quest_decode_bounds_triton(query.to(DEVICE), dlo.to(DEVICE), dhi.to(DEVICE), *dev[3:], cap).cpu()
        want, want_counts = select_top_pages_reference(bounds, cols, HKV, k_cap)
        assert torch.equal(counts.cpu(), want_counts)
        for r, k in enumerate(counts.tolist()):
            assert sorted(got[r, :k].tolist()) == want[r, :k].tolist()
        return
    got = quest_decode_bounds_triton(*dev, cap, scale=scale.to(DEVICE)).cpu()
    for r in range(len(seq_lens)):
        k, p_lo, p_hi = (int(cols[r, c]) for c in (SELECT, HEAD, TAIL))
        if not k:
            continue
        blocks = batch.block_table[r, p_lo:p_hi].long()
        want = page_upper_bounds(query[r : r + 1], dlo[blocks].transpose(0, 1), dhi[blocks].transpose(0, 1))
        exact = page_upper_bounds(query[r : r + 1], kmin[blocks].transpose(0, 1), kmax[blocks].transpose(0, 1))
        rows = got[r * HKV : (r + 1) * HKV, p_lo:p_hi]
        torch.testing.assert_close(rows, want.amax(dim=1), rtol=1e-4, atol=1e-4)
        assert (rows >= exact.amax(dim=1) - 1e-4).all()  # the codes' bounds are at least the planes' bounds


@in_process
def test_quoka_decode_scores_match_reference():
    seq_lens = [150, 70]
    policy = SparseConfig(method="quoka", dense_below_tokens=0, sink_tokens=4, local_tokens=8, budget=BUDGET,
                          sparse_decode=True).for_layer(1)  # fmt: skip
    cols = _selectable_rows(seq_lens, policy)
    batch = _cache(seq_lens, seed=9)
    layout = PageLayout.of(batch.kv_cache, HKV, "interleaved")
    query = randn(len(seq_lens), HKV * G, D, g=gen(2))
    page_keys = layout.page_keys(batch.kv_cache)
    got = quoka_decode_scores_triton(
        query.to(DEVICE), page_keys.to(DEVICE), batch.block_table.to(DEVICE), cols.to(DEVICE), HKV,
        layout.num_head_slots, 64,
    ).cpu()  # fmt: skip
    for r in range(len(seq_lens)):
        k, lo, hi = (int(cols[r, c]) for c in (SELECT, HEAD, TAIL))
        assert k > 0
        ids = layout.page_ids(batch.block_table[r, lo:hi].long()[None, :], torch.arange(HKV)[:, None])
        want = score_pages(group_query(query[r : r + 1], HKV), page_keys[ids])
        torch.testing.assert_close(got[r * HKV : (r + 1) * HKV, lo:hi], want, rtol=1e-4, atol=1e-4)


def _write_meta(batch, method):
    layout = PageLayout.of(batch.kv_cache, HKV, "interleaved")
    planes = MetaPlanes.for_method(method, HKV, N, D, batch.kv_cache.dtype)
    meta = None if planes is None else planes.views(batch.kv_cache)
    if meta is not None:
        for r, s in enumerate(batch.seq_lens):
            pos = torch.arange(s)
            slots = batch.block_table[r, pos // N].long() * N + pos % N
            write_page_minmax(layout, batch.kv_cache, meta, slots)
            if meta.codes is not None:
                write_int4_shadow(meta, batch.keys[r], slots, N, batch.kv_cache.dtype)
    return layout, meta


@in_process
@pytest.mark.parametrize(
    "method,extra",
    [
        ("quoka", {"sparse_decode": True}),
        ("quest", {}),
        ("quest", {"quest": {"gqa_reduce": "sum"}}),
        ("quest", {"quest": {"gqa_reduce": "union"}}),
        ("quest", {"quest": {"decode_planes": "int8"}}),
        ("quest", {"quest": {"gqa_reduce": "sum", "decode_planes": "int8"}}),
        ("twilight", {"twilight": {"top_p": 1.0}}),
        ("twilight", {"twilight": {"top_p": 0.8}}),
        ("twilight", {"twilight": {"top_p": 1.0}, "quest": {"decode_planes": "int8"}}),
    ],
)
def test_select_decode_matches_per_request_selection(method, extra):
    """The device path picks the pages the host-planned per-request selector picks."""
    seq_lens = [230, 60, 5, 181]
    cfg = SparseConfig(method=method, dense_below_tokens=16, sink_tokens=4, local_tokens=12,
                       budget=BUDGET, **extra)  # fmt: skip
    policy = cfg.for_layer(1)
    meta_slots = 0 if method == "quoka" else MetaPlanes.for_method(method, HKV, N, D, torch.float32).num_slots
    batch = _cache(seq_lens, meta_slots=meta_slots, seed=13)
    layout, meta = _write_meta(batch, method)
    query = randn(len(seq_lens), HKV * G, D, g=gen(4)) * 2
    selector = make_selector(cfg, D**-0.5)
    for sub in (selector, getattr(selector, "base", None)):
        if sub is not None:
            sub.batch_decode = False  # the per-request reference path
    plan = plan_step(policy, N, list(range(len(seq_lens) + 1)), seq_lens)
    want = selector(query, layout.page_keys(batch.kv_cache), batch.block_table, layout, plan, meta)

    step = DecodeColumns([policy], N, 8, 512, "cpu").write(np.array(seq_lens), batch.block_table)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    step = type(step)(**{**step.__dict__, "block_table": dev(step.block_table),
                         "columns": {p: dev(c) for p, c in step.columns.items()}})  # fmt: skip
    meta_dev = None if meta is None else type(meta)(*(dev(t) for t in meta))
    pages, counts = selector.select_decode(
        query.to(DEVICE), layout.page_keys(batch.kv_cache.to(DEVICE)), layout, meta_dev, step, policy
    )
    pages, counts = pages.cpu(), counts.cpu()
    assert torch.equal(counts, want.counts) or method == "twilight"
    for r in range(len(seq_lens) * HKV):
        got_set = set(pages[r, : int(counts[r])].tolist())
        want_set = set(want.indices[r, : int(want.counts[r])].tolist())
        if method == "twilight" and cfg.twilight.top_p < 1:  # float sums may move the top-p boundary
            assert len(got_set ^ want_set) <= 1, (r, got_set, want_set)
        else:
            assert got_set == want_set, (r, got_set, want_set)


@in_process
def test_int8_decode_planes_are_what_decode_steps_read():
    """Under ``quest.decode_planes: int8`` a decode step ranks pages by the INT8 codes alone: planes in
    the cache dtype overwritten after the write change the default selection and leave this one."""
    seq_lens = [230, 181, 97]
    picks = {}
    for planes_cfg in ("cache", "int8"):
        cfg = SparseConfig(method="quest", dense_below_tokens=16, sink_tokens=4, local_tokens=12, budget=BUDGET,
                           quest={"decode_planes": planes_cfg})  # fmt: skip
        policy = cfg.for_layer(1)
        batch = _cache(seq_lens, meta_slots=MetaPlanes.for_method("quest", HKV, N, D, torch.float32).num_slots, seed=21)
        layout, meta = _write_meta(batch, "quest")
        query = randn(len(seq_lens), HKV * G, D, g=gen(6)) * 2
        selector = make_selector(cfg, D**-0.5)
        step = DecodeColumns([policy], N, 8, 512, "cpu").write(np.array(seq_lens), batch.block_table)
        dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
        step = type(step)(**{**step.__dict__, "block_table": dev(step.block_table),
                             "columns": {p: dev(c) for p, c in step.columns.items()}})  # fmt: skip
        for garbage in (False, True):
            if garbage:  # the planes in the cache dtype, reversed along the pages
                meta.kmin.copy_(meta.kmin.flip(0))
                meta.kmax.copy_(meta.kmax.flip(0))
            meta_dev = type(meta)(*(dev(t) for t in meta))
            pages, counts = selector.select_decode(
                query.to(DEVICE), layout.page_keys(batch.kv_cache.to(DEVICE)), layout, meta_dev, step, policy
            )
            picks[planes_cfg, garbage] = [sorted(pages[r, : int(counts[r])].tolist()) for r in range(pages.shape[0])]
    assert picks["int8", False] == picks["int8", True]
    assert picks["cache", False] != picks["cache", True]


@in_process
@pytest.mark.parametrize("top_p", [0.5, 0.9, 1.0])
@pytest.mark.parametrize("g", [1, 3, 4])
@pytest.mark.parametrize("mode", ["mass", "mass_valid", "log_valid"])
def test_top_p_select_matches_sort(top_p, g, mode):
    """Masses (every column, or the row's ``num_valid``) and log-masses up to a constant per head;
    columns past ``num_valid`` hold huge values that must not be read."""
    from vllm_sparse.kernels.top_p import top_p_select_reference, top_p_select_triton

    r, k, f = 6, 40, 5
    cnt = torch.tensor([40, 17, 0, 1, 33, 2], dtype=torch.int32)
    width = k + f
    raw = torch.rand(r, g, width, generator=gen(g)) ** 4
    col = torch.arange(width)[None, :]
    num_valid = (cnt + torch.where(cnt > 0, torch.tensor([f, 2, 0, 5, 0, 1]), 0)).to(torch.int32)
    valid = col < num_valid[:, None]
    if mode == "log_valid":
        mass = torch.where(valid[:, None, :], torch.log2(raw) + randn(r, g, 1, g=gen(1)) * 30, 1e4)
    else:
        mass = torch.where(valid[:, None, :], raw, 0.0 if mode == "mass" else 1e4)
        mass = mass / torch.where(valid[:, None, :], mass, 0.0).sum(-1, keepdim=True).clamp(min=1e-30)
    cand = torch.randperm(1000, generator=gen(7))[: r * k].view(r, k).to(torch.int32)
    args = (cnt, cand, top_p, None if mode == "mass" else num_valid, mode == "log_valid")
    dev_args = [a.to(DEVICE) if torch.is_tensor(a) else a for a in args]
    got_pages, got_counts = (t.cpu() for t in top_p_select_triton(mass.to(DEVICE), *dev_args))
    want_pages, want_counts = top_p_select_reference(mass, *args)
    assert torch.equal(got_counts, want_counts)
    for row in range(r):
        c = int(want_counts[row])
        kept = set(want_pages[row, :c].tolist())
        assert got_pages[row, :c].tolist() == [p for p in cand[row, : int(cnt[row])].tolist() if p in kept]
    if top_p >= 1:
        assert torch.equal(want_counts, cnt)


@in_process
@pytest.mark.parametrize("g", [3, 4])
def test_top_p_select_rows_wider_than_a_tile(g):
    """Rows with more candidates than the kernel keeps in registers (the rest is re-read)."""
    from vllm_sparse.kernels.top_p import top_p_select_reference, top_p_select_triton

    k, f = 4500, 7  # 2048 candidates per head in registers (G = 3, 4)
    cnt = torch.tensor([4500, 2100, 2048, 2049], dtype=torch.int32)
    num_valid = cnt + f
    lse = randn(4, g, k + f, g=gen(g)) * 3
    cand = torch.arange(4 * k, dtype=torch.int32).view(4, k)
    for top_p in (0.3, 0.95):
        dev = (t.to(DEVICE) for t in (lse, cnt, cand))
        got_pages, got_counts = top_p_select_triton(*dev, top_p, num_valid.to(DEVICE), log_mass=True)
        got_pages, got_counts = got_pages.cpu(), got_counts.cpu()
        want_pages, want_counts = top_p_select_reference(lse, cnt, cand, top_p, num_valid, log_mass=True)
        assert torch.equal(got_counts, want_counts) and int(want_counts.min()) > 10
        for row in range(4):
            c = int(want_counts[row])
            assert got_pages[row, :c].tolist() == sorted(want_pages[row, :c].tolist())


def _twilight_step(seq_lens, group, seed):
    """A decode step of twilight rows (sparse, dense and padding rows): cache with its shadows,
    columns, queries."""
    policy = SparseConfig(method="twilight", dense_below_tokens=16, sink_tokens=4, local_tokens=12,
                          budget=BUDGET).for_layer(1)  # fmt: skip
    slots = MetaPlanes.for_method("twilight", HKV, N, D, torch.float32).num_slots
    batch = _cache([max(s, 1) for s in seq_lens], meta_slots=slots, seed=seed)
    layout, meta = _write_meta(batch, "twilight")
    step = DecodeColumns([policy], N, 8, 512, "cpu").write(np.array(seq_lens), batch.block_table)
    query = randn(len(seq_lens), HKV * group, D, g=gen(seed + 1)) * 2
    return policy, layout, meta, step, query


@in_process
@pytest.mark.parametrize("group", [3, 4])
@pytest.mark.parametrize("programs", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_page_lse_matches_twin(group, programs, dtype):
    """The decode estimate builds each row's page list (candidates, then forced past pages) and
    estimates it like the twins: rows with candidates below the cap, with none (dense, padding:
    seq_len 0) and with ``SELECT > 0`` but 0 candidates; one or several programs per row; float32
    queries (split into float16 high and low parts) and bfloat16 ones."""
    from vllm_sparse.kernels.twilight_estimate import LOG2E, decode_page_lse_triton
    from vllm_sparse.metadata.int4_shadow import dequantize_int4
    from vllm_sparse.selectors.twilight import decode_row_pages, estimate_page_mass_rows, forced_cap

    seq_lens = [230, 0, 160, 5, 181, 297]
    policy, _, meta, step, query = _twilight_step(seq_lens, group, seed=17)
    query = query.to(dtype)
    cols, cap = step.columns[policy], step.select_caps[policy]
    g = gen(group)
    rows = len(seq_lens) * HKV
    cand = torch.full((rows, cap), -7, dtype=torch.int32)  # never read past the count
    cnt = torch.zeros(rows, dtype=torch.int32)
    for r in range(rows):
        k, lo, hi = (int(cols[r // HKV, c]) for c in (SELECT, HEAD, TAIL))
        k = 0 if r == 10 else max(0, k - r % 3)  # below SELECT; row 10 (SELECT > 0) has none
        cand[r, :k] = (torch.randperm(hi - lo, generator=g)[:k] + lo).int()
        cnt[r] = k
    assert int(cols[5, SELECT]) > 0 and int(cnt[10]) == 0 and int(cols[1, SELECT]) == int(cols[3, SELECT]) == 0
    fc = forced_cap(policy, N)
    dev = [t.to(DEVICE) for t in (query, meta.codes, meta.scale, meta.zero, step.block_table, cols, cand, cnt)]
    lse, num_valid = decode_page_lse_triton(*dev, D**-0.5, fc, programs=programs)
    lse, num_valid = lse.cpu(), num_valid.cpu()
    blocks, want_valid = decode_row_pages(cand, cnt, cols, step.block_table, HKV, fc)
    assert torch.equal(num_valid, want_valid)
    assert torch.equal(num_valid > 0, cnt > 0) and int((cnt > 0).sum()) == 7
    query = query.float()
    mass = estimate_page_mass_rows(query, meta, blocks, N, D**-0.5)
    for r in range(rows):
        m = int(num_valid[r])
        if not m:
            continue
        torch.testing.assert_close(torch.softmax(lse[r, :, :m] * math.log(2), dim=-1), mass[r, :, :m])
        h = r % HKV
        blk = blocks[r, :m]
        keys = dequantize_int4(meta.codes[blk, h], meta.scale[blk, h], meta.zero[blk, h])  # [m, N, D]
        q = query[r // HKV, h * group : (h + 1) * group]
        logits = torch.einsum("gd,mnd->gmn", q, keys) * D**-0.5
        torch.testing.assert_close(lse[r, :, :m], torch.logsumexp(logits, dim=-1) * LOG2E, rtol=1e-5, atol=1e-4)


@in_process
@pytest.mark.parametrize("group", [3, 4])
@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_twilight_select_decode_matches_twins(group, top_p):
    """Twilight's whole decode selection (Quest candidates, the in-kernel page lists, the one-pass
    estimate, top-p over log-masses) keeps the pages of the torch twins' pipeline (page lists,
    mass estimate, sort + cumulative sum), padding and dense rows included."""
    from vllm_sparse.kernels.top_p import top_p_select_reference
    from vllm_sparse.selectors.twilight import decode_row_pages, estimate_page_mass_rows, forced_cap

    seq_lens = [230, 0, 160, 5, 181, 297]
    policy, layout, meta, step, query = _twilight_step(seq_lens, group, seed=23)
    selector = make_selector(SparseConfig(method="twilight", twilight={"top_p": top_p}), D**-0.5)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    step_dev = type(step)(**{**step.__dict__, "block_table": dev(step.block_table),
                             "columns": {p: dev(c) for p, c in step.columns.items()}})  # fmt: skip
    meta_dev = type(meta)(*(None if t is None else dev(t) for t in meta))
    args = (dev(query), None, layout, meta_dev, step_dev, policy)
    pages, counts = (t.cpu() for t in selector.select_decode(*args))
    cand, cand_counts = (t.cpu() for t in selector.base.select_decode(*args))
    blocks, num_valid = decode_row_pages(cand, cand_counts, step.columns[policy], step.block_table, HKV,
                                         forced_cap(policy, N))  # fmt: skip
    mass = estimate_page_mass_rows(query, meta, blocks, N, D**-0.5)
    want, want_counts = top_p_select_reference(mass, cand_counts, cand, top_p, num_valid)
    sparse = cand_counts > 0
    assert int(sparse.sum()) == 8 and bool((counts[~sparse] == 0).all())
    assert bool((counts[sparse] < cand_counts[sparse]).any()) or top_p > 0.9
    for r in range(len(seq_lens) * HKV):
        got_set = set(pages[r, : int(counts[r])].tolist())
        want_set = set(want[r, : int(want_counts[r])].tolist())
        assert len(got_set ^ want_set) <= 1, (r, got_set, want_set)  # float sums may move the boundary
        assert len(got_set) == int(counts[r]) and got_set <= set(cand[r, : int(cand_counts[r])].tolist())


@in_process
@pytest.mark.parametrize("programs", [1, 3, None, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kascade_anchor_decode_mass_matches_twin(programs, dtype):
    """Kascade's decode anchor mass (one pass over the keys into per-page log-sum-exps, then the
    pooled weights; lengths from the columns) equals the twin on every row's past pages: rows of
    different lengths, one shorter than a page and a padding row (0); 70 programs per row leave
    most shares empty and make pass 2 combine the shares' log-sum-exps in two tiles."""
    from vllm_sparse.kernels.anchor_mass_decode import anchor_decode_mass, anchor_decode_mass_triton

    seq_lens = [230, 0, 3, 97, 181]
    batch = _cache([max(s, 1) for s in seq_lens], dtype=dtype, seed=21)
    layout = PageLayout.of(batch.kv_cache, HKV, "interleaved")
    cfg = SparseConfig(method="kascade", dense_below_tokens=0, budget=BUDGET, kascade={"anchors": [0, 1]})
    policy = cfg.for_layer(1)
    cols = torch.from_numpy(DecodeColumns([policy], N, 8, 256, "cpu").write(np.array(seq_lens), batch.block_table)
                            .host_columns[policy])  # fmt: skip
    query = randn(len(seq_lens), HKV * G, D, g=gen(5), dtype=dtype) * 2
    page_keys = layout.page_keys(batch.kv_cache)
    cap = 256 // N + 1
    work = torch.full((8 * HKV, G, cap), 7.0, device=DEVICE)  # a persistent workspace wider than the step
    got = anchor_decode_mass_triton(
        query.to(DEVICE), page_keys.to(DEVICE), batch.block_table.to(DEVICE), cols.to(DEVICE), HKV,
        layout.num_head_slots, D**-0.5, work, programs=programs,
    )  # fmt: skip
    assert got.shape == (len(seq_lens) * HKV, cap) and got.data_ptr() == work.data_ptr()  # the head-0 plane
    got = got.cpu()
    want = anchor_decode_mass(query.float(), page_keys.float(), batch.block_table, seq_lens, HKV,
                              layout.num_head_slots, D**-0.5, cap)  # fmt: skip
    # float32 on CUDA: the products run in TF32 (10-bit mantissa; measured up to 0.3% on an H100)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3 if DEVICE == "cuda" else 1e-5
    for r in range(len(seq_lens) * HKV):
        past = max(seq_lens[r // HKV] - 1, 0) // N
        torch.testing.assert_close(got[r, :past], want[r, :past], rtol=tol, atol=tol)
        if past:  # a softmax's share: at most 1 over the past pages
            assert float(got[r, :past].sum()) <= 1 + 1e-4


def _kascade_step(cfg: SparseConfig, policy, seq_lens: list[int], block_table: torch.Tensor):
    """A decode step with an anchor buffer for layer 0's and ``policy``'s columns, on ``DEVICE``."""
    cols = DecodeColumns([cfg.for_layer(0), policy], N, 8, 512, "cpu", num_kv_heads=HKV, anchor_scores=True,
                         group_size=G)  # fmt: skip
    step = cols.write(np.array(seq_lens), block_table)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    work = dev(step.anchor_work)
    return type(step)(**{**step.__dict__, "block_table": dev(step.block_table), "anchor": work[:, 0],
                         "anchor_work": work, "columns": {p: dev(c) for p, c in step.columns.items()}})  # fmt: skip


@in_process
@pytest.mark.parametrize("head_map", [None, {1: [1, 0]}])
def test_kascade_select_decode_matches_host_planned_selection(head_map):
    """An anchor layer scores the decode rows on the device; it and a reuse layer (with a head map)
    then pick the pages the host-planned selector picks from the same anchor."""
    seq_lens = [230, 60, 5, 181]
    kascade = {"anchors": [0, 2], **({"head_map": head_map} if head_map else {})}
    cfg = SparseConfig(method="kascade", dense_below_tokens=16, sink_tokens=4, local_tokens=12, budget=BUDGET,
                       kascade=kascade)  # fmt: skip
    batch = _cache(seq_lens, seed=13)
    layout = PageLayout.of(batch.kv_cache, HKV, "interleaved")
    page_keys = layout.page_keys(batch.kv_cache)
    query = randn(len(seq_lens), HKV * G, D, g=gen(4)) * 2
    base = make_selector(cfg, D**-0.5)
    anchor, reuse = base.for_layer(0, 4), base.for_layer(1, 4)
    policy = cfg.for_layer(1)
    plan = plan_step(policy, N, list(range(len(seq_lens) + 1)), seq_lens)
    anchor.observe(query, page_keys, batch.block_table, layout, plan)
    want = reuse(query, page_keys, batch.block_table, layout, plan)

    step = _kascade_step(cfg, policy, seq_lens, batch.block_table)
    q, keys = query.to(DEVICE), page_keys.to(DEVICE)
    anchor.observe_decode(q, keys, layout, step)
    reuse.observe_decode(q, keys, layout, step)  # not an anchor: leaves the scores alone
    pages, counts = reuse.select_decode(q, keys, layout, None, step, policy)
    pages, counts = pages.cpu(), counts.cpu()
    assert torch.equal(counts, want.counts)
    for r in range(len(seq_lens) * HKV):
        got_set = set(pages[r, : int(counts[r])].tolist())
        assert got_set == set(want.indices[r, : int(want.counts[r])].tolist()), r


@in_process
def test_kascade_decode_selects_once_per_anchor():
    """The layers that reuse one anchor share one top-k per step (``DecodeStep.anchor_pick``): a
    reuse layer with a head map gathers its rows from it and still picks what the host-planned
    selector picks from the mapped scores; the next anchor's layers select afresh."""
    seq_lens = [230, 60, 181]
    cfg = SparseConfig(method="kascade", dense_below_tokens=16, sink_tokens=4, local_tokens=12, budget=BUDGET,
                       kascade={"anchors": [0, 3], "head_map": {2: [1, 0]}})  # fmt: skip
    batch = _cache(seq_lens, seed=17)
    layout = PageLayout.of(batch.kv_cache, HKV, "interleaved")
    page_keys = layout.page_keys(batch.kv_cache)
    query = randn(len(seq_lens), HKV * G, D, g=gen(6)) * 2
    base = make_selector(cfg, D**-0.5)
    layers = [base.for_layer(i, 5) for i in range(5)]
    policy = cfg.for_layer(1)
    assert all(cfg.for_layer(i) == policy for i in (1, 2, 3, 4))
    plan = plan_step(policy, N, list(range(len(seq_lens) + 1)), seq_lens)

    step = _kascade_step(cfg, policy, seq_lens, batch.block_table)
    q, keys = query.to(DEVICE), page_keys.to(DEVICE)
    picked = []
    for i, layer in enumerate(layers[1:], start=1):
        layer.observe(query, page_keys, batch.block_table, layout, plan)  # host-planned anchors (0 ran below)
        if i == 1:
            layers[0].observe(query, page_keys, batch.block_table, layout, plan)
            layers[0].observe_decode(q, keys, layout, step)
        layer.observe_decode(q, keys, layout, step)
        want = layer(query, page_keys, batch.block_table, layout, plan)
        pages, counts = (t.cpu() for t in layer.select_decode(q, keys, layout, None, step, policy))
        picked.append((step.anchor_pick.layer, step.anchor_pick.pages.data_ptr()))
        assert torch.equal(counts, want.counts), i
        for r in range(len(seq_lens) * HKV):
            got_set = set(pages[r, : int(counts[r])].tolist())
            assert got_set == set(want.indices[r, : int(want.counts[r])].tolist()), (i, r)
    assert [a for a, _ in picked] == [0, 0, 3, 3]
    assert picked[0][1] == picked[1][1] and picked[2][1] == picked[3][1] != picked[0][1]
