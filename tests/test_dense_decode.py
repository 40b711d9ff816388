"""Which decode rows go to FlashAttention (``backend.dense_decode``), decided without a GPU: layers whose policy
decodes every row dense, statically (so a captured graph fits every replay), and the A/B switch."""

from __future__ import annotations

import pytest

from vllm_sparse.backend.dense_decode import DENSE_DECODE_ENV, DenseDecode, dense_decode_kernel
from vllm_sparse.config import SparseConfig


def test_dense_decode_policies_are_those_whose_every_decode_row_is_dense():
    quoka = SparseConfig(method="quoka")
    assert quoka.for_layer(3).decodes_dense  # QuoKA decodes dense by default
    assert not SparseConfig(method="quoka", sparse_decode=True).for_layer(3).decodes_dense
    quest = SparseConfig(method="quest", dense_layers=[0], layers={5: {"sparse_decode": False}})
    assert quest.for_layer(0).decodes_dense  # a dense layer
    assert quest.for_layer(5).decodes_dense  # a layer that decodes dense
    assert not quest.for_layer(3).decodes_dense  # selects (by cost on GPUs): stays on the decode kernels
    assert SparseConfig(method="compact").for_layer(3).decodes_dense  # prefill-only method


def test_the_switch_reads_flash_or_triton_and_refuses_anything_else():
    assert dense_decode_kernel({}) == "flash"
    assert dense_decode_kernel({DENSE_DECODE_ENV: ""}) == "flash"
    assert dense_decode_kernel({DENSE_DECODE_ENV: " Triton "}) == "triton"
    with pytest.raises(ValueError, match="flash, triton"):
        dense_decode_kernel({DENSE_DECODE_ENV: "fa4"})


def test_without_flashattention_3_or_when_switched_off_there_is_no_plan(monkeypatch):
    import torch

    args = (32, 8, 128, 16, torch.bfloat16, 16, 32, 32, torch.device("cpu"))
    monkeypatch.setattr("vllm_sparse.backend.dense_decode.flash_attn_version", lambda *a: None)
    assert DenseDecode.create(*args) is None  # no FlashAttention on this platform (CPUs)
    monkeypatch.setattr("vllm_sparse.backend.dense_decode.flash_attn_version", lambda *a: 2)
    assert DenseDecode.create(*args) is None  # FA2: no scheduler metadata for graphs, the Triton kernel stays
    monkeypatch.setattr("vllm_sparse.backend.dense_decode.flash_attn_version", lambda *a: 3)
    monkeypatch.setenv(DENSE_DECODE_ENV, "triton")
    assert DenseDecode.create(*args) is None


def test_the_plan_and_a_layers_call_give_the_decode_kernels_twin_over_dense_columns():
    """``DenseDecode.plan`` then ``run_dense_decode`` through FlashAttention's torch twin, on the head-major cache's
    strided NHD view with metadata slots and a strided query: every row attends its whole context, as the Triton
    decode kernel's twin reads dense columns (``HEAD = TAIL = 0``); padding rows are left alone."""
    import numpy as np
    import torch

    from vllm_sparse.backend.dense_decode import run_dense_decode
    from vllm_sparse.backend.flash_rows import flash_varlen_reference
    from vllm_sparse.kernels.decode_attention import decode_attention_reference
    from vllm_sparse.layout import PageLayout
    from vllm_sparse.policy import LAST, NUM_COLUMNS, TOTAL

    def attend(**kw):
        kw.pop("scheduler_metadata"), kw.pop("num_splits")
        return flash_varlen_reference(**kw)

    calls = []

    def schedule(**kw):
        calls.append(kw)
        return torch.arange(3, dtype=torch.int32)

    hq, hkv, page, d = 12, 2, 16, 32
    planner = DenseDecode(hq, hkv, d, page, torch.float32, max_reqs=8, max_graph_batch=4, max_splits=32,
                          device=torch.device("cpu"), attend=attend, schedule=schedule)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(300, hkv + 2, page, 2 * d, generator=gen)  # two metadata slots after the heads
    layout = PageLayout.of(cache, hkv, "interleaved")
    for lens in ([1, 17, 1000, 0], [4000, 33], [5, 640, 1500, 3000, 2222, 0]):
        b = len(lens)
        table = torch.stack([torch.randperm(300, generator=gen)[:256] for _ in lens]).int()
        qkv = torch.randn(b, hq + 2 * hkv, d, generator=gen)
        query, out = qkv[:, :hq], torch.zeros(b, hq, d)
        plan = planner.plan(torch.tensor(lens, dtype=torch.int32), max(lens))
        assert plan.num_splits == (32 if b <= 4 else 0) and calls[-1]["batch_size"] == b
        run_dense_decode(plan, query, layout.keys(cache), layout.values(cache), table, d**-0.5, out)
        n = np.asarray(lens)
        total = -(-n // page)
        cols = torch.zeros(b, NUM_COLUMNS, dtype=torch.int32)
        cols[:, TOTAL] = torch.from_numpy(total).int()
        cols[:, LAST] = torch.from_numpy(np.where(n > 0, n - (total - 1) * page, 0)).int()
        rows = b * hkv
        want = decode_attention_reference(query, layout.page_keys(cache), layout.page_values(cache), table,
                                          torch.zeros(rows, 1, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
                                          cols, layout.num_head_slots, d**-0.5)  # fmt: skip
        live = torch.from_numpy(n > 0)
        assert torch.allclose(out[live], want[live], atol=1e-5), lens
        assert (out[~live] == 0).all()
