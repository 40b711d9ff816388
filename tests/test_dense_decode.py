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
