"""Selected decode rows as FlashAttention sequences (``backend.sparse_decode_rows``), checked without a GPU:

- the row-table kernel (``kernels.decode_row_tables``, Triton's interpreter on CPU) equals its torch twin, padding,
  dense and sparse rows alike;
- those tables read by the torch twin of FlashAttention's paged call (``flash_rows.flash_varlen_reference``) give the
  Triton decode kernel's twin (``decode_attention_reference``): the same tokens in the same order;
- the lengths the builder plans on the host (``row_lengths``) are the ones the kernel writes for rows that select
  exactly ``SELECT`` pages;
- the switch, and no plan without FlashAttention 3.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from triton_interpret import DEVICE, in_process, rerun_in_fresh_process

triton = pytest.importorskip("triton", reason="triton is not installed")

from helpers import single_thread  # noqa: E402,F401  (autouse fixture)

from vllm_sparse.backend.flash_rows import flash_varlen_reference  # noqa: E402
from vllm_sparse.backend.sparse_decode_rows import (  # noqa: E402
    SPARSE_DECODE_ENV,
    SparseDecodeRows,
    row_lengths,
    sparse_decode_kernel,
)
from vllm_sparse.config import SparseConfig  # noqa: E402
from vllm_sparse.kernels.decode_attention import decode_attention_reference  # noqa: E402
from vllm_sparse.kernels.decode_row_tables import decode_row_tables_reference, decode_row_tables_triton  # noqa: E402
from vllm_sparse.policy import HEAD, SELECT, TAIL, decode_columns, select_cap  # noqa: E402

test_in_fresh_process = rerun_in_fresh_process(__file__)

MAX_LEN = 4096


def _case(seed: int, hkv: int, page: int, seqs: list[int], sparse_decode: bool = True):
    """Columns of a Quest policy (sink, local window, budget) for ``seqs``, a random block table with distinct
    blocks, and a selection of exactly ``SELECT`` distinct logical pages per row from ``[HEAD, TAIL)``."""
    rng = random.Random(seed)
    cfg = SparseConfig(method="quest", sparse_decode=sparse_decode, sink_tokens=rng.choice([0, 16, 40]),
                       local_tokens=rng.choice([0, 64, 200]), dense_below_tokens=rng.choice([0, 300]),
                       budget={"fraction": rng.choice([0.125, 0.25]), "min_tokens": 0})  # fmt: skip
    policy = cfg.for_layer(3)
    cols = decode_columns(policy, page, np.array(seqs))
    cap = max(1, select_cap(policy, page, MAX_LEN))
    b, max_blocks = len(seqs), MAX_LEN // page + 1
    blocks = torch.stack([torch.randperm(3 * max_blocks, generator=torch.Generator().manual_seed(seed + i))[:max_blocks]
                          for i in range(b)]).int()  # fmt: skip
    pages, counts = _selection(cols, hkv, cap, rng)
    return torch.from_numpy(cols).int(), blocks, pages, counts


def _selection(cols: np.ndarray, hkv: int, cap: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly ``SELECT`` distinct logical pages per row from ``[HEAD, TAIL)`` (``int32 [B * Hkv, cap]``), and the
    counts."""
    pages = torch.zeros(cols.shape[0] * hkv, cap, dtype=torch.int32)
    for r in range(pages.shape[0]):
        c = cols[r // hkv]
        pick = rng.sample(range(int(c[HEAD]), int(c[TAIL])), int(c[SELECT]))
        pages[r, : len(pick)] = torch.tensor(pick, dtype=torch.int32)
    return pages, torch.from_numpy(np.repeat(cols[:, SELECT], hkv)).int()


SEQS = [0, 1, 17, 250, 333, 1000, 2049, 4000]  # padding, dense (short), sparse; lengths ending inside a page


@in_process
@pytest.mark.parametrize("hkv", [1, 2, 8])
@pytest.mark.parametrize("page", [16, 32])
def test_kernel_equals_twin(hkv, page):
    cols, blocks, pages, counts = _case(hkv * 100 + page, hkv, page, SEQS)
    slots = hkv + 3  # metadata slots after the heads
    width = MAX_LEN // page + 1
    table = torch.full((len(SEQS) * hkv, width), -7, dtype=torch.int32)
    lens = torch.full((len(SEQS) * hkv,), -7, dtype=torch.int32)
    t, lens_d = table.to(DEVICE), lens.to(DEVICE)
    decode_row_tables_triton(blocks.to(DEVICE), pages.to(DEVICE), counts.to(DEVICE), cols.to(DEVICE), slots, page,
                             t, lens_d)  # fmt: skip
    want_tables, want_lens = decode_row_tables_reference(blocks, pages, counts, cols, slots, page)
    assert torch.equal(lens_d.cpu(), want_lens)
    assert torch.equal(lens_d.cpu().long(), torch.from_numpy(np.repeat(row_lengths(cols.numpy(), page), hkv)))
    for r, want in enumerate(want_tables):
        got = t.cpu()[r]
        assert torch.equal(got[: want.numel()].long(), want), r
        assert (got[want.numel() :] == -7).all()  # nothing written past a row's entries
    assert any(x.numel() > 0 for x in want_tables) and (want_lens == 0).any()
    sparse = cols[:, SELECT] > 0
    assert sparse.any() and (~sparse & (cols[:, 3] > 0)).any()  # sparse rows and dense rows both present


@pytest.mark.parametrize("hkv,g", [(2, 6), (8, 4)])
def test_tables_read_by_flashattention_give_the_decode_kernel(hkv, g):
    page, d, slots = 16, 32, hkv + 1
    cols, blocks, pages, counts = _case(7 + hkv, hkv, page, SEQS)
    gen = torch.Generator().manual_seed(hkv)
    num_blocks = int(blocks.max()) + 1
    cache_k = torch.randn(num_blocks * slots, page, d, generator=gen)  # [num_pages, N, D] by page id
    cache_v = torch.randn(num_blocks * slots, page, d, generator=gen)
    b = len(SEQS)
    query = torch.randn(b, hkv * g, d, generator=gen)
    want = decode_attention_reference(query, cache_k, cache_v, blocks, pages, counts, cols, slots, 0.3)

    tables, lens = decode_row_tables_reference(blocks, pages, counts, cols, slots, page)
    width = max(1, max(x.numel() for x in tables))
    table = torch.zeros(b * hkv, width, dtype=torch.int32)
    for r, x in enumerate(tables):
        table[r, : x.numel()] = x.int()
    out = torch.zeros(b * hkv, g, d)
    flash_varlen_reference(
        q=query.reshape(b * hkv, g, d), k=cache_k.unsqueeze(2), v=cache_v.unsqueeze(2), out=out,
        cu_seqlens_q=torch.arange(b * hkv + 1, dtype=torch.int32), max_seqlen_q=1, seqused_k=lens,
        max_seqlen_k=int(lens.max()), softmax_scale=0.3, causal=True, block_table=table, fa_version=3,
    )  # fmt: skip
    got = out.view(b, hkv * g, d)
    empty = lens.view(b, hkv)[:, 0] == 0
    assert torch.allclose(got[~empty], want[~empty], atol=1e-5)  # padding rows: FlashAttention leaves them


def test_switch_defaults_to_triton_and_refuses_anything_else():
    assert sparse_decode_kernel({}) == "triton"
    assert sparse_decode_kernel({SPARSE_DECODE_ENV: " Flash "}) == "flash"
    with pytest.raises(ValueError, match="triton, flash"):
        sparse_decode_kernel({SPARSE_DECODE_ENV: "fa4"})


def test_no_plan_unless_switched_on_with_flashattention_3(monkeypatch):
    policy = SparseConfig(method="quest").for_layer(3)
    args = ([policy], 32, 8, 128, 16, torch.bfloat16, 16, 4096, 32, 32, torch.device("cpu"))
    monkeypatch.setattr("vllm_sparse.backend.sparse_decode_rows.flash_attn_version", lambda *a: 3)
    assert SparseDecodeRows.create(*args) is None  # the default: the Triton decode kernel
    monkeypatch.setenv(SPARSE_DECODE_ENV, "flash")
    monkeypatch.setattr("vllm_sparse.backend.sparse_decode_rows.flash_attn_version", lambda *a: None)
    assert SparseDecodeRows.create(*args) is None  # no FlashAttention on this platform
    monkeypatch.setattr("vllm_sparse.backend.sparse_decode_rows.flash_attn_version", lambda *a: 2)
    assert SparseDecodeRows.create(*args) is None
    monkeypatch.setattr("vllm_sparse.backend.sparse_decode_rows.flash_attn_version", lambda *a: 3)
    assert SparseDecodeRows.create([], *args[1:]) is None  # no selecting policy


def _twin_attend(**kw):
    """FlashAttention's paged varlen call through its torch twin (which schedules on its own)."""
    kw.pop("scheduler_metadata"), kw.pop("num_splits")
    return flash_varlen_reference(**kw)


def _twin_schedule(**kw):
    """A stand-in for FA3's scheduler metadata: records what the plan asked for."""
    _twin_schedule.calls.append(kw)
    return torch.arange(5, dtype=torch.int32)


@in_process
@pytest.mark.parametrize("device_counts", [False, True])
def test_the_builders_plan_and_a_layers_call_give_the_decode_kernel(device_counts):
    """``SparseDecodeRows.plan`` on a real step of decode columns, then ``run_sparse_rows`` (the row-table kernel,
    FlashAttention's twin) over a query whose rows are strided as vLLM's query slices are: the decode kernel's twin,
    steps after steps through the same persistent buffers, with lengths of growing and shrinking batches. With
    ``device_counts`` (Twilight's top-p) rows keep fewer than ``SELECT`` pages, counted on the device only: the plan
    asks for no scheduler metadata and the lengths are the kernel's."""
    from vllm_sparse.backend.sparse_decode_rows import run_sparse_rows
    from vllm_sparse.decode_step import DecodeColumns

    hq, hkv, page, d, slots = 12, 2, 16, 32, 3
    policy = SparseConfig(method="quest", sink_tokens=16, local_tokens=64, dense_below_tokens=300,
                          budget={"fraction": 0.125, "min_tokens": 0}).for_layer(3)  # fmt: skip
    cpu = torch.device("cpu")
    columns = DecodeColumns([policy], page, 8, MAX_LEN, cpu, num_kv_heads=hkv)
    _twin_schedule.calls = []
    rows = SparseDecodeRows([policy], hq, hkv, d, page, torch.float32, max_reqs=8, max_model_len=MAX_LEN,
                            max_graph_batch=4, max_splits=32, device=cpu, device_counts=device_counts,
                            attend=_twin_attend, schedule=_twin_schedule)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(800, slots, page, 2 * d, generator=gen)
    page_keys = cache.view(800 * slots, page, 2 * d)[:, :, :d]  # the interleaved head-major layout's views
    page_values = cache.view(800 * slots, page, 2 * d)[:, :, d:]
    for step, seqs in enumerate([[4000, 17, 2500, 0], [333, 4096], [1, 640, 1500, 3000, 2222, 0]]):
        b = len(seqs)
        rng = random.Random(step)
        block_table = torch.stack([torch.randperm(800, generator=gen)[: MAX_LEN // page + 1] for _ in seqs]).int()
        decode = columns.write(np.array(seqs), block_table)
        cols = decode.host_columns[policy]
        pages, counts = _selection(cols, hkv, max(1, columns.select_caps[policy]), rng)
        if device_counts:  # top-p: a prefix of each row's selection, at least one page where it selects any
            counts = torch.tensor([rng.randint(min(1, int(c)), int(c)) for c in counts], dtype=torch.int32)
        qkv = torch.randn(b, hq + 2 * hkv, d, generator=gen)  # the query a slice of a fused projection
        query = qkv[:, :hq]
        out = torch.zeros(b, hq, d)
        plan = rows.plan(decode)[policy]
        assert plan.rows == b * hkv and plan.num_splits == (32 if b <= 4 else 0)
        assert plan.max_len == max(1, int(row_lengths(cols, page).max()))  # exact, or the bound
        if device_counts:
            assert plan.scheduler is None and not _twin_schedule.calls
        else:
            assert _twin_schedule.calls[-1]["batch_size"] == b * hkv
            assert _twin_schedule.calls[-1]["max_seqlen_k"] == plan.max_len
        run_sparse_rows(plan, query, page_keys, page_values, decode.block_table, pages, counts,
                        decode.columns[policy], slots, d**-0.5, out)  # fmt: skip
        want = decode_attention_reference(query, page_keys, page_values, block_table, pages, counts,
                                          decode.columns[policy], slots, d**-0.5)  # fmt: skip
        live = torch.tensor(seqs) > 0
        assert torch.allclose(out[live], want[live], atol=1e-5), step
        assert (cols[:, SELECT] > 0).any()
        assert not device_counts or (counts < torch.from_numpy(np.repeat(cols[:, SELECT], hkv))).any()
