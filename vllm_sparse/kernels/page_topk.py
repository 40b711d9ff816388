"""Triton per-row top-k of page scores with counts and ranges read on the device; twin:
``select_top_pages_reference``.

Row ``r = request * Hkv + head`` picks the ``k = columns[request, SELECT]`` best pages among its
selectable past pages ``[HEAD, TAIL)`` (``policy.decode_columns``: the forced sink and local pages
lie outside that range). Every length is read on the device and the grid is one program per row,
so the kernel captures into a CUDA graph once and replays for any lengths.

One program per row finds the k-th largest score exactly by a radix select over the scores'
32-bit order-preserving keys, most significant 8-bit digit first: each of 4 passes over the row
(which stays in L1/L2) takes a histogram of the next digit among the pages whose higher digits
equal the k-th key's, and fixes that digit. A last pass writes the pages above the k-th key and,
in ascending page order, as many pages equal to it as ``k`` needs: 5 passes where a bisection
over the keys takes 34. The search stops early once the pages sharing the digits fixed so far are
exactly the ones still needed (their count equals the rank sought): every one of them is taken and
the last pass compares keys by those digits only, which selects the same pages (with continuous
scores it usually stops after the third digit: on an H100 10-17% faster, session 26). A row of
at most one tile of pages loads its keys once and takes every histogram and the write from
registers (``_select_in_registers``; on an H100 at 16 x 16K, pages of 32: the top-k 9.6 -> 8.6 us,
Quest's one-launch selection 24.8 -> 23.2 us, session 28). Rows asked
for every selectable page skip the search. Rows are long and few at long contexts (8 rows of 8192 pages for one Llama-3.1-8B request at 128K), so the warps
per program grow with the row width fixed at engine start where the batch has few rows
(``select_num_warps``).

Quest's decode rows can be scored by the same program before it ranks them (``quest=``): the
bounds then need no launch of their own (on an H100, 16 x 16K at pages of 32: 0.025 ms for both
against 0.026 in two launches; 32 x 16K 0.037 against 0.041, session 27).

Few long rows leave most SMs idle, so there each row is split into ``chunks`` programs
(``split_chunks``, fixed per batch size): five launches, one per pass, each program taking the
histogram of its chunk and writing it out; every program of the next pass sums its row's chunk
histograms to fix the digits so far (the same choice in every program, no atomics, no grid-wide
wait). The last launch writes each chunk's pages at offsets that the chunk histograms give: a page
above the k-th key differs from it first at some digit, where its digit is larger, so the pages
above it in the chunks before are a sum over their histograms.

On a GPU the five passes run as one launch (``_split_fused_kernel``): after each histogram the chunk
programs of a row meet at a barrier (an atomic counter per row, which the row's last program resets
for the next launch), so a pass costs a barrier instead of a kernel boundary (on an H100, 8 rows of
8,159 pages: 0.019 ms against 0.023 for five launches, in a CUDA graph). Programs that wait on each
other must all be resident at once, so the grid is at most one program per SM; Triton's interpreter
runs programs one after another and takes the five launches.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vllm_sparse.kernels.paged_attention import num_sms
from vllm_sparse.kernels.pdl import launch_options, pdl_wait_then_release
from vllm_sparse.kernels.quest_rows import QuestRows, quest_row_bounds
from vllm_sparse.policy import HEAD, NUM_COLUMNS, SELECT, TAIL

RADIX_BITS = 8
SIGN = tl.constexpr(-2147483648)  # the int32 sign bit


@triton.jit
def _key(x):
    """int32 keys ordered as the float32 values ``x`` are (for non-NaN values; -0.0 is 0.0)."""
    i = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    return tl.where(i < 0, i ^ 0x7FFFFFFF, i)


@triton.jit
def _row_range(cols_ptr, req, NCOLS: tl.constexpr, C_SELECT: tl.constexpr, C_HEAD: tl.constexpr, C_TAIL: tl.constexpr):
    """``(k, lo, hi)``: a request's rows pick ``k`` pages among ``[lo, hi)``."""
    c = cols_ptr + req * NCOLS
    return tl.load(c + C_SELECT), tl.load(c + C_HEAD), tl.load(c + C_TAIL)


@triton.jit
def _fix_digit(hist, live, rank, BITS: tl.constexpr):
    """The next digit of the k-th largest key from the ``hist`` of that digit among the ``live``
    pages sharing the digits fixed so far, the k-th being ``rank``-th largest among them:
    ``(digit, rank among the pages sharing it too, how many pages share it)``."""
    b = tl.arange(0, 1 << BITS)
    above = live - tl.cumsum(hist, 0)  # live pages whose digit exceeds b
    digit = tl.sum(((above + hist) >= rank).to(tl.int32)) - 1  # largest b with >= rank at or above it
    return digit, rank - tl.sum(tl.where(b == digit, above, 0)), tl.sum(tl.where(b == digit, hist, 0))


@triton.jit
def _write_selected(row_ptr, out, lo, hi, t, shift, n_above, n_equal, first_eq, k, BLOCK: tl.constexpr):
    """Write pages ``[lo, hi)`` whose key is above the k-th key ``t`` at ``n_above`` on, in page
    order, and those equal to it at ``first_eq + n_equal`` on while below ``k``; keys are compared
    by their bits from ``shift`` up (the digits the search fixed)."""
    ts = t >> shift  # arithmetic shifts keep the order of the signed keys
    for p0 in range(lo, hi, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        m = p < hi
        key = _key(tl.load(row_ptr + p, mask=m, other=0.0)) >> shift
        gt = (key > ts) & m
        eq = (key == ts) & m
        pos_gt = n_above + tl.cumsum(gt.to(tl.int32), 0) - 1
        tl.store(out + pos_gt, p, mask=gt)
        pos_eq = first_eq + n_equal + tl.cumsum(eq.to(tl.int32), 0) - 1
        tl.store(out + pos_eq, p, mask=eq & (pos_eq < k))
        n_above += tl.sum(gt.to(tl.int32))
        n_equal += tl.sum(eq.to(tl.int32))


@triton.jit
def _select_in_registers(row_ptr, out, lo, hi, k, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """The search and the write of ``_select_pages_kernel`` for a row of at most ``BLOCK`` pages
    ``[lo, hi)``: its scores are loaded once, and each digit's histogram and the write read the
    keys from registers (the same pages as the tiled passes)."""
    p = lo + tl.arange(0, BLOCK)
    m = p < hi
    u = _key(tl.load(row_ptr + p, mask=m, other=0.0)) ^ SIGN  # unsigned keys (the order of the scores)
    b = tl.arange(0, 1 << BITS)
    prefix = tl.zeros([], tl.int32)
    live = hi - lo
    rank = k
    shift = tl.full([], 32 - BITS, tl.int32)
    for i in tl.static_range(32 // BITS):
        if rank < live:  # (as in the tiled search: stop once every live page is taken)
            mm = m
            if i > 0:  # (pages whose higher digits are the k-th key's)
                mm = mm & (((u ^ prefix) >> (32 - BITS * i)) == 0)
            hist = tl.histogram(tl.where(mm, (u >> (32 - BITS * (i + 1))) & ((1 << BITS) - 1), 0), 1 << BITS)
            hist -= tl.where(b == 0, BLOCK - live, 0)  # the lanes left out went to bin 0
            digit, rank, live = _fix_digit(hist, live, rank, BITS)
            prefix = prefix | (digit << (32 - BITS * (i + 1)))
            shift = tl.full([], 32 - BITS * (i + 1), tl.int32)
    ts = (prefix ^ SIGN) >> shift  # the k-th largest key's digits; the first `rank` pages sharing them are taken
    key = (u ^ SIGN) >> shift
    gt = (key > ts) & m
    eq = (key == ts) & m
    tl.store(out + tl.cumsum(gt.to(tl.int32), 0) - 1, p, mask=gt)
    pos_eq = k - rank + tl.cumsum(eq.to(tl.int32), 0) - 1
    tl.store(out + pos_eq, p, mask=eq & (pos_eq < k))


@triton.jit
def _digit_counts(row_ptr, lo, hi, prefix, live, SHIFT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """``int32 [2**BITS]``: how many of pages ``[lo, hi)`` have each value of the digit at bit
    ``SHIFT`` of their unsigned key (``_key ^ SIGN``), among the ``live`` pages whose digits above
    it equal ``prefix``'s. The other lanes go to bin 0 and are taken off it at the end (no
    ``mask`` argument to ``tl.histogram``, which older Triton releases lack)."""
    hist = tl.zeros([1 << BITS], tl.int32)
    for p0 in range(lo, hi, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        m = p < hi
        u = _key(tl.load(row_ptr + p, mask=m, other=0.0)) ^ SIGN
        if SHIFT + BITS < 32:
            m = m & (((u ^ prefix) >> (SHIFT + BITS)) == 0)
        hist += tl.histogram(tl.where(m, (u >> SHIFT) & ((1 << BITS) - 1), 0), 1 << BITS)
    dead = tl.cdiv(hi - lo, BLOCK) * BLOCK - live
    return hist - tl.where(tl.arange(0, 1 << BITS) == 0, dead, 0)


@triton.jit(do_not_specialize=["stride_s", "stride_o"])
def _select_pages_kernel(
    scores_ptr,
    cols_ptr,
    out_ptr,
    count_ptr,
    stride_s,
    stride_o,
    q_ptr,
    kmin_ptr,
    kmax_ptr,
    bt_ptr,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_mb,
    stride_mh,
    scale_ptr,
    stride_sb,
    stride_sh,
    HKV: tl.constexpr,
    NCOLS: tl.constexpr,
    C_SELECT: tl.constexpr,
    C_HEAD: tl.constexpr,
    C_TAIL: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    QUEST: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait_then_release(USE_PDL)
    row = tl.program_id(0)
    k, lo, hi = _row_range(cols_ptr, row // HKV, NCOLS, C_SELECT, C_HEAD, C_TAIL)
    tl.store(count_ptr + row, k)
    if k > 0:
        row_ptr = scores_ptr + row.to(tl.int64) * stride_s
        out = out_ptr + row.to(tl.int64) * stride_o
        if k >= hi - lo:  # every selectable page
            for p0 in range(lo, hi, BLOCK):
                p = p0 + tl.arange(0, BLOCK)
                tl.store(out + (p - lo), p, mask=p < hi)
        else:
            if QUEST:  # score the row's pages first (its program reads them back below)
                quest_row_bounds(q_ptr, kmin_ptr, kmax_ptr, bt_ptr, row_ptr, row // HKV, row % HKV, lo, hi, stride_qt,
                                 stride_qh, stride_bt, stride_mb, stride_mh, scale_ptr, stride_sb, stride_sh, 0, G,
                                 BLOCK_G, D, BLOCK_D, BLOCK_P, True, LOW_PRECISION, SCALED)  # fmt: skip
                tl.debug_barrier()
            if hi - lo <= BLOCK:  # one tile: the row's keys are loaded once and stay in registers
                _select_in_registers(row_ptr, out, lo, hi, k, BITS, BLOCK)
            else:
                # the k-th largest unsigned key, digit by digit: `prefix` holds the digits fixed so far,
                # `live` the pages sharing them, `rank` the k-th key's rank among those (1 = largest);
                # the search stops once every live page is taken (`rank == live`)
                prefix = tl.zeros([], tl.int32)
                live = hi - lo
                rank = k
                shift = tl.full([], 32 - BITS, tl.int32)
                for i in tl.static_range(32 // BITS):
                    if rank < live:
                        hist = _digit_counts(row_ptr, lo, hi, prefix, live, 32 - BITS * (i + 1), BITS, BLOCK)
                        digit, rank, live = _fix_digit(hist, live, rank, BITS)
                        prefix = prefix | (digit << (32 - BITS * (i + 1)))
                        shift = tl.full([], 32 - BITS * (i + 1), tl.int32)
                t = prefix ^ SIGN  # the k-th largest key's digits; `rank` pages sharing them are taken
                zero = tl.zeros([], tl.int32)
                _write_selected(row_ptr, out, lo, hi, t, shift, zero, zero, k - rank, k, BLOCK)


@triton.jit
def _chunk_digit_counts(row_ptr, lo, hi, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """``_digit_counts`` over pages ``[lo, hi)`` of one chunk (the live pages of a chunk are not
    known in advance: the lanes left out are counted here)."""
    hist = tl.zeros([1 << BITS], tl.int32)
    dead = tl.zeros([], tl.int32)
    for p0 in range(lo, hi, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        m = p < hi
        u = _key(tl.load(row_ptr + p, mask=m, other=0.0)) ^ SIGN
        if SHIFT + BITS < 32:
            m = m & (((u ^ prefix) >> (SHIFT + BITS)) == 0)
        hist += tl.histogram(tl.where(m, (u >> SHIFT) & ((1 << BITS) - 1), 0), 1 << BITS)
        dead += BLOCK - tl.sum(m.to(tl.int32))
    return hist - tl.where(tl.arange(0, 1 << BITS) == 0, dead, 0)


@triton.jit
def _replay_digits(hist_ptr, chunk, n_chunks, k, live, PASSES: tl.constexpr, BITS: tl.constexpr, BLOCK_C: tl.constexpr):
    """The first ``PASSES`` digits of the k-th largest key of a row from its chunk histograms
    (``hist_ptr``: ``int32 [4, n_chunks, 2**BITS]``), as ``_select_pages_kernel`` fixes them:
    ``(prefix, rank, live, above_before, equal_before, shift)``: ``above_before`` and
    ``equal_before`` the pages of the chunks before ``chunk`` above the digits so far and equal to
    them, ``shift`` the lowest bit fixed (the search stops early once every live page is taken)."""
    b = tl.arange(0, 1 << BITS)
    cc = tl.arange(0, BLOCK_C)
    prefix = tl.zeros([], tl.int32)
    rank = k
    above_before = tl.zeros([], tl.int32)
    equal_before = tl.zeros([], tl.int32)
    shift = tl.full([], 32 - BITS, tl.int32)
    for i in tl.static_range(PASSES):
        if rank < live:  # (the search stops once every live page is taken)
            per_chunk = tl.load(
                hist_ptr + (i * n_chunks + cc)[:, None] * (1 << BITS) + b[None, :],
                mask=(cc < n_chunks)[:, None],
                other=0,
            )
            digit, rank, live = _fix_digit(tl.sum(per_chunk, axis=0), live, rank, BITS)
            prefix = prefix | (digit << (32 - BITS * (i + 1)))
            before = tl.where((cc < chunk)[:, None], per_chunk, 0)
            above_before += tl.sum(tl.where(b[None, :] > digit, before, 0))
            equal_before = tl.sum(tl.where(b[None, :] == digit, before, 0))
            shift = tl.full([], 32 - BITS * (i + 1), tl.int32)
    return prefix, rank, live, above_before, equal_before, shift


@triton.jit
def _chunk_range(lo, hi, chunk, n_chunks):
    span = tl.cdiv(hi - lo, n_chunks)
    c_lo = lo + chunk * span
    return c_lo, tl.minimum(hi, c_lo + span)


@triton.jit(do_not_specialize=["stride_s", "n_chunks"])
def _split_pass_kernel(
    scores_ptr,
    cols_ptr,
    hist_ptr,
    stride_s,
    n_chunks,
    HKV: tl.constexpr,
    NCOLS: tl.constexpr,
    C_SELECT: tl.constexpr,
    C_HEAD: tl.constexpr,
    C_TAIL: tl.constexpr,
    PASS: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    k, lo, hi = _row_range(cols_ptr, row // HKV, NCOLS, C_SELECT, C_HEAD, C_TAIL)
    if (k > 0) & (k < hi - lo):
        hist_row = hist_ptr + row.to(tl.int64) * (4 * n_chunks << BITS)
        prefix, rank, live, _, _, _ = _replay_digits(hist_row, chunk, n_chunks, k, hi - lo, PASS, BITS, BLOCK_C)
        if rank < live:  # (else the search has stopped: this pass is not needed)
            c_lo, c_hi = _chunk_range(lo, hi, chunk, n_chunks)
            row_ptr = scores_ptr + row.to(tl.int64) * stride_s
            hist = _chunk_digit_counts(row_ptr, c_lo, c_hi, prefix, 32 - BITS * (PASS + 1), BITS, BLOCK)
            tl.store(hist_row + (PASS * n_chunks + chunk) * (1 << BITS) + tl.arange(0, 1 << BITS), hist)


@triton.jit(do_not_specialize=["stride_s", "stride_o", "n_chunks"])
def _split_write_kernel(
    scores_ptr,
    cols_ptr,
    hist_ptr,
    out_ptr,
    count_ptr,
    stride_s,
    stride_o,
    n_chunks,
    HKV: tl.constexpr,
    NCOLS: tl.constexpr,
    C_SELECT: tl.constexpr,
    C_HEAD: tl.constexpr,
    C_TAIL: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    k, lo, hi = _row_range(cols_ptr, row // HKV, NCOLS, C_SELECT, C_HEAD, C_TAIL)
    if chunk == 0:
        tl.store(count_ptr + row, k)
    out = out_ptr + row.to(tl.int64) * stride_o
    c_lo, c_hi = _chunk_range(lo, hi, chunk, n_chunks)
    if (k > 0) & (k >= hi - lo):  # every selectable page
        for p0 in range(c_lo, c_hi, BLOCK):
            p = p0 + tl.arange(0, BLOCK)
            tl.store(out + (p - lo), p, mask=p < c_hi)
    elif k > 0:
        hist_row = hist_ptr + row.to(tl.int64) * (4 * n_chunks << BITS)
        prefix, rank, _, n_above, n_equal, shift = _replay_digits(
            hist_row, chunk, n_chunks, k, hi - lo, 32 // BITS, BITS, BLOCK_C
        )
        t = prefix ^ SIGN  # the k-th largest key's digits; the first `rank` pages sharing them are taken
        row_ptr = scores_ptr + row.to(tl.int64) * stride_s
        _write_selected(row_ptr, out, c_lo, c_hi, t, shift, n_above, n_equal, k - rank, k, BLOCK)


@triton.jit
def _row_barrier(sync_ptr, target):
    """Arrive at a barrier of the programs of one row and wait until ``target`` arrivals in all: the
    row's chunk programs arrive once per pass, so pass ``i`` waits for ``(i + 1) * n_chunks``. The
    CTA barrier before the release makes every thread's histogram stores visible with it; the one
    after the acquire orders every thread's later loads."""
    tl.debug_barrier()
    n = tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu") + 1
    while n < target:
        n = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["stride_s", "stride_o", "n_chunks"])
def _split_fused_kernel(
    scores_ptr,
    cols_ptr,
    hist_ptr,
    sync_ptr,
    out_ptr,
    count_ptr,
    stride_s,
    stride_o,
    n_chunks,
    HKV: tl.constexpr,
    NCOLS: tl.constexpr,
    C_SELECT: tl.constexpr,
    C_HEAD: tl.constexpr,
    C_TAIL: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The five passes of ``_split_pass_kernel`` and ``_split_write_kernel`` in one launch: the
    chunk programs of a row meet at a barrier after each histogram (``_row_barrier``), so every
    grid must fit on the GPU at once (``fused_ok``); the last program of a row to leave zeroes the
    row's two counters (``sync_ptr``: arrivals, departures) for the next launch."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    k, lo, hi = _row_range(cols_ptr, row // HKV, NCOLS, C_SELECT, C_HEAD, C_TAIL)
    if chunk == 0:
        tl.store(count_ptr + row, k)
    out = out_ptr + row.to(tl.int64) * stride_o
    c_lo, c_hi = _chunk_range(lo, hi, chunk, n_chunks)
    if (k > 0) & (k >= hi - lo):  # every selectable page
        for p0 in range(c_lo, c_hi, BLOCK):
            p = p0 + tl.arange(0, BLOCK)
            tl.store(out + (p - lo), p, mask=p < c_hi)
    elif k > 0:
        hist_row = hist_ptr + row.to(tl.int64) * (4 * n_chunks << BITS)
        row_ptr = scores_ptr + row.to(tl.int64) * stride_s
        sync = sync_ptr + 2 * row
        b = tl.arange(0, 1 << BITS)
        cc = tl.arange(0, BLOCK_C)
        prefix = tl.zeros([], tl.int32)
        rank = k
        live = hi - lo
        above_before = tl.zeros([], tl.int32)
        equal_before = tl.zeros([], tl.int32)
        shift = tl.full([], 32 - BITS, tl.int32)
        for i in tl.static_range(32 // BITS):
            if rank < live:  # every program of the row decides alike: they stop together
                hist = _chunk_digit_counts(row_ptr, c_lo, c_hi, prefix, 32 - BITS * (i + 1), BITS, BLOCK)
                tl.store(hist_row + (i * n_chunks + chunk) * (1 << BITS) + b, hist)
                _row_barrier(sync, (i + 1) * n_chunks)
                per_chunk = tl.load(
                    hist_row + (i * n_chunks + cc)[:, None] * (1 << BITS) + b[None, :],
                    mask=(cc < n_chunks)[:, None],
                    other=0,
                    cache_modifier=".cg",  # written by other SMs during this launch: not from L1
                )
                digit, rank, live = _fix_digit(tl.sum(per_chunk, axis=0), live, rank, BITS)
                prefix = prefix | (digit << (32 - BITS * (i + 1)))
                before = tl.where((cc < chunk)[:, None], per_chunk, 0)
                above_before += tl.sum(tl.where(b[None, :] > digit, before, 0))
                equal_before = tl.sum(tl.where(b[None, :] == digit, before, 0))
                shift = tl.full([], 32 - BITS * (i + 1), tl.int32)
        t = prefix ^ SIGN  # the k-th largest key's digits; the first `rank` pages sharing them are taken
        _write_selected(row_ptr, out, c_lo, c_hi, t, shift, above_before, equal_before, k - rank, k, BLOCK)
        tl.debug_barrier()
        if tl.atomic_add(sync + 1, 1, sem="acq_rel", scope="gpu") == n_chunks - 1:  # the row's last to leave
            tl.atomic_xchg(sync, 0)
            tl.atomic_xchg(sync + 1, 0)


MAX_CHUNKS = 16
QUEST_BLOCK_P = 128  # pages per tile of the Quest bounds scored inside the top-k (``quest=``)
MIN_CHUNK_PAGES = 512


def fused_ok(device: torch.device) -> bool:
    """Whether the one-launch split top-k runs on ``device``: a GPU, not Triton's interpreter."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def split_chunks(page_cap: int, rows: int, sms: int) -> int:
    """Programs per row of the top-k, from the row width fixed at engine start and the batch's
    rows (never from the data): 1 (one program a row) for many rows or short rows, else enough
    chunks of at least ``MIN_CHUNK_PAGES`` pages to give every SM about one program (16 chunks
    for the 8 rows of one Llama-3.1-8B request at 128K on an H100)."""
    if rows > 32 or page_cap <= 2 * MIN_CHUNK_PAGES:
        return 1
    return max(1, min(MAX_CHUNKS, sms // max(rows, 1), -(-page_cap // MIN_CHUNK_PAGES)))


def select_num_warps(page_cap: int, rows: int) -> int:
    """Warps per row program, from the row width fixed at engine start and the batch's rows (never
    from the data): a few long rows (one or two requests of a long context) get more of an SM each,
    many rows keep 4 warps. On an H100, 8 rows of 8192 pages: 0.042 ms with 16 warps against 0.082
    for the previous bisection; 512 rows of 2048 pages with 16 warps: 0.086 against 0.042."""
    if rows > 32 or page_cap <= 1024:
        return 4
    return 8 if page_cap <= 4096 else 16


def select_top_pages_triton(
    scores: torch.Tensor,
    columns: torch.Tensor,
    num_kv_heads: int,
    k_cap: int,
    chunks: int | None = None,
    fused: bool | None = None,
    counters: torch.Tensor | None = None,
    quest: QuestRows | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_p: int = QUEST_BLOCK_P,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best pages of every (request, KV head) row.

    Args:
        scores: ``float32 [B * Hkv, P]`` page scores (higher is better); only ``[HEAD, TAIL)`` of
            each row is read (other entries may hold anything). With ``quest``, a workspace that
            the kernels fill with the rows' Quest bounds before they select.
        columns: ``int32 [B, NUM_COLUMNS]`` decode columns (``policy.decode_columns``), device.
        num_kv_heads: ``Hkv``.
        k_cap: the widest selection any row can ask for (``DecodeStep.select_caps``).
        chunks: programs per row (default ``split_chunks``; 1: the one-program kernel).
        fused: the split passes in one launch whose chunk programs meet at barriers
            (``_split_fused_kernel``; default: on a GPU where the grid fits at once, never in Triton's
            interpreter, which runs programs one after another; else the five launches).
        counters: ``int32 [>= 2 * B * Hkv]`` zeros that the one-launch kernel's barriers count in
            and leave zero (``DecodeStep.topk_counters``, a persistent buffer of the metadata
            builder, so that a captured graph replays with them); None: fresh zeros per call.
        quest: score the pages in the same launch, by Quest's bounds with the ``max`` GQA rule
            (``quest_rows.quest_row_bounds``): each row's program scores the pages it then ranks, so
            the bounds need no launch of their own. One program a row only (``chunks`` 1: many rows;
            few long rows score faster over the many programs of the bounds kernel: on an H100, 8
            rows of 4,079 pages 0.030 ms against 0.026, session 27). Rows that select nothing or
            every selectable page are not scored.
        num_warps, num_stages, block_p: warps per program (default 4 for the split kernels,
            ``select_num_warps`` for one program a row), pipeline stages (Triton's default) and
            pages per tile of the Quest bounds (``QUEST_BLOCK_P``): tuning knobs for
            ``benchmarks/bench_quest_select_gpu.py``.
    Returns:
        ``(pages int32 [B * Hkv, max(k_cap, 1)], counts int32 [B * Hkv])``: each row's first
        ``counts[row] = columns[request, SELECT]`` entries are distinct logical pages (entries past
        it are unspecified).
    """
    rows = scores.shape[0]
    out = torch.empty(rows, max(k_cap, 1), dtype=torch.int32, device=scores.device)
    counts = torch.empty(rows, dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out, counts
    assert scores.stride(-1) == 1 and columns.is_contiguous() and columns.shape[1] == NUM_COLUMNS
    page_cap = scores.shape[1]
    chunks = chunks or split_chunks(page_cap, rows, num_sms(scores.device))
    launch = {} if num_stages is None else {"num_stages": num_stages}
    if fused is None:  # (the grids serving asks for always fit: ``split_chunks``; a caller's own may not)
        fused = chunks > 1 and fused_ok(scores.device) and rows * chunks <= num_sms(scores.device)
    if chunks > 1 or fused:
        assert quest is None, "Quest bounds are scored inside the one-program-a-row kernel only (chunks=1)"
        hist = torch.empty(rows, 32 // RADIX_BITS, chunks, 1 << RADIX_BITS, dtype=torch.int32, device=scores.device)
        consts = dict(HKV=num_kv_heads, NCOLS=NUM_COLUMNS, C_SELECT=SELECT, C_HEAD=HEAD, C_TAIL=TAIL, BITS=RADIX_BITS,
                      BLOCK=max(128, min(1024, triton.next_power_of_2(-(-page_cap // chunks)))),
                      BLOCK_C=triton.next_power_of_2(chunks), num_warps=num_warps or 4, **launch)  # fmt: skip
        if fused:
            assert chunks == 1 or rows * chunks <= num_sms(scores.device), "a fused grid must fit on the GPU at once"
            if counters is None:
                counters = torch.zeros(2 * rows, dtype=torch.int32, device=scores.device)
            assert counters.numel() >= 2 * rows and counters.dtype == torch.int32
            _split_fused_kernel[(rows, chunks)](
                scores, columns, hist, counters, out, counts,
                scores.stride(0), out.stride(0), chunks, **consts,
            )  # fmt: skip
            return out, counts
        for i in range(32 // RADIX_BITS):
            _split_pass_kernel[(rows, chunks)](scores, columns, hist, scores.stride(0), chunks, PASS=i, **consts)
        _split_write_kernel[(rows, chunks)](
            scores, columns, hist, out, counts, scores.stride(0), out.stride(0), chunks, **consts,
        )  # fmt: skip
        return out, counts
    if quest is None:  # (pointers the kernel never reads)
        q_args = (scores,) * 4 + (0,) * 5 + (scores, 0, 0)
        q_consts = dict(QUEST=False, G=1, BLOCK_G=16, D=1, BLOCK_D=16, BLOCK_P=16, LOW_PRECISION=False, SCALED=False)
    else:
        assert quest.query.shape[0] * quest.kmin.shape[1] == rows and quest.kmin.shape[1] == num_kv_heads
        q_args = quest.args()
        q_consts = dict(QUEST=True, BLOCK_P=block_p, **quest.constants())
    warps = num_warps or select_num_warps(page_cap, rows)
    _select_pages_kernel[(rows,)](
        scores, columns, out, counts, scores.stride(0), out.stride(0), *q_args,
        HKV=num_kv_heads, NCOLS=NUM_COLUMNS, C_SELECT=SELECT, C_HEAD=HEAD, C_TAIL=TAIL, BITS=RADIX_BITS,
        BLOCK=256 * warps, num_warps=warps, **q_consts, **launch, **launch_options(scores.device),
    )  # fmt: skip
    return out, counts


def select_top_pages_reference(
    scores: torch.Tensor,
    columns: torch.Tensor,
    num_kv_heads: int,
    k_cap: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``select_top_pages_triton``: the same pages, each row's sorted ascending (a
    stable descending sort per row, so that ties at the k-th score go to the lower pages)."""
    rows = scores.shape[0]
    out = torch.zeros(rows, max(k_cap, 1), dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    cols = columns.cpu()
    for r in range(rows):
        k, lo, hi = (int(cols[r // num_kv_heads, c]) for c in (SELECT, HEAD, TAIL))
        counts[r] = k
        if k:
            order = torch.sort(scores[r, lo:hi].float().cpu(), descending=True, stable=True).indices
            out[r, :k] = (order[:k] + lo).sort().values.int()
    return out, counts
