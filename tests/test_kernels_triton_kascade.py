"""Kascade's anchor scoring Triton kernel (kernels/anchor_mass.py) against its torch twin, on random
paged caches: prefill chunks of several tiles (partial last tile, chunk starting inside a page),
decode tokens, GQA groups of 1 to 4, fp32 and bf16. Without CUDA it runs through Triton's
interpreter (``TRITON_INTERPRET=1``) at small shapes; see tests/triton_interpret.py."""

from __future__ import annotations

import pytest
import torch
from triton_interpret import DEVICE, HAS_CUDA, in_process, rerun_in_fresh_process

triton = pytest.importorskip("triton", reason="triton is not installed")

from helpers import gen, randn, single_thread  # noqa: F401

from vllm_sparse.kernels.anchor_mass import anchor_page_mass, anchor_page_mass_triton

test_in_fresh_process = rerun_in_fresh_process(__file__)


@in_process
@pytest.mark.parametrize("c,ctx", [(1, 100), (37, 50), (70, 64), (5, 40)])
@pytest.mark.parametrize("hkv,group,n", [(2, 2, 16), (1, 4, 32), (2, 1, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_anchor_mass_matches_twin(c, ctx, hkv, group, n, dtype):
    g = gen(c * 1000 + ctx + hkv * 10 + group)
    d = 32
    pages = -(-(ctx + c) // n)
    slots = hkv + 1  # one extra head slot, as metadata planes add: page ids are b * slots + h
    num_blocks = pages + 3
    page_keys = randn(num_blocks * slots, n, d, g=g, dtype=dtype)
    blocks = torch.randperm(num_blocks, generator=g)[:pages]
    page_ids = blocks[None, :] * slots + torch.arange(hkv)[:, None]
    q = randn(c, hkv * group, d, g=g, dtype=dtype)
    scale = d**-0.5
    want = anchor_page_mass(q, page_keys, page_ids, ctx, scale, tile=32)
    got = anchor_page_mass_triton(q.to(DEVICE), page_keys.to(DEVICE), page_ids.to(DEVICE), ctx, scale, tile=32)
    assert got.shape == want.shape == (hkv, ctx // n)
    tol = 1e-5 if dtype == torch.float32 and not HAS_CUDA else 2e-2
    torch.testing.assert_close(got.cpu(), want, atol=tol * want.max().item(), rtol=tol)


@in_process
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_anchor_mass_programs_walking_several_key_blocks_match_twin(steps):
    """Pass 2 with each program walking ``steps`` key blocks (the last program partly past the end)
    gives the twin's mass on every past page."""
    g = gen(77 + steps)
    hkv, group, n, d, c, ctx = 2, 2, 16, 32, 40, 300  # 18 past pages: 5 blocks of 4 pages
    pages = -(-(ctx + c) // n)
    page_keys = randn((pages + 2) * hkv, n, d, g=g)
    page_ids = torch.randperm(pages + 2, generator=g)[:pages][None, :] * hkv + torch.arange(hkv)[:, None]
    q = randn(c, hkv * group, d, g=g)
    want = anchor_page_mass(q, page_keys, page_ids, ctx, d**-0.5, tile=32)
    got = anchor_page_mass_triton(q.to(DEVICE), page_keys.to(DEVICE), page_ids.to(DEVICE), ctx, d**-0.5,
                                  tile=32, steps=steps).cpu()  # fmt: skip
    tol = 2e-2 if HAS_CUDA else 1e-5
    assert got.shape == want.shape == (hkv, ctx // n)
    torch.testing.assert_close(got, want, atol=tol * want.max().item(), rtol=tol)


@in_process
@pytest.mark.parametrize("c,tile,stride", [(150, 16, 4), (70, 32, 2), (40, 16, 7)])  # tiles 2 6; 0 2; 2
def test_anchor_mass_tile_stride_matches_twin(c, tile, stride):
    """The scored tiles of a stride (the last, then every ``stride``-th before it; partial last tiles
    and strides past the chunk included) give the twin's mass."""
    g = gen(c + stride)
    hkv, group, n, d, ctx = 2, 2, 16, 32, 90  # the chunk starts inside a page
    pages = -(-(ctx + c) // n)
    page_keys = randn((pages + 2) * hkv, n, d, g=g)
    page_ids = torch.randperm(pages + 2, generator=g)[:pages][None, :] * hkv + torch.arange(hkv)[:, None]
    q = randn(c, hkv * group, d, g=g)
    want = anchor_page_mass(q, page_keys, page_ids, ctx, d**-0.5, tile, stride)
    got = anchor_page_mass_triton(q.to(DEVICE), page_keys.to(DEVICE), page_ids.to(DEVICE), ctx, d**-0.5, tile,
                                  stride).cpu()  # fmt: skip
    tol = 2e-2 if HAS_CUDA else 1e-5
    assert got.shape == want.shape == (hkv, ctx // n)
    torch.testing.assert_close(got, want, atol=tol * want.max().item(), rtol=tol)
    if stride < 3:  # (tile 0 scored or not: see test_selector_kascade's stride test)
        return
    assert not torch.allclose(want, anchor_page_mass(q, page_keys, page_ids, ctx, d**-0.5, tile))
