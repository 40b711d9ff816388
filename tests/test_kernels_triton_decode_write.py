"""The one-launch decode-step writer (kernels/kv_write.py, ``write_decode_step_triton``) against the generic stage-0 writers run
one after the other (its twin): the same cache bytes, K/V and every metadata plane, for each
method's planes, cache dtypes, page offsets 0 .. N-1 and CUDA-graph padding slots.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (see
tests/test_kernels_triton.py for the fresh-process trick); with CUDA it runs compiled.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpret import DEVICE, in_process, rerun_in_fresh_process

triton = pytest.importorskip("triton", reason="triton is not installed")

from helpers import gen, randn, single_thread  # noqa: F401  (autouse fixture)

from vllm_sparse.kernels.kv_write import write_decode_step_triton
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.int4_shadow import write_int4_shadow
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.metadata.writer import write_kv_reference

test_in_fresh_process = rerun_in_fresh_process(__file__)


def _cache(method, hkv, n, d, dtype, num_blocks, g):
    """A never-zeroed cache (garbage everywhere, metadata included) with the method's planes."""
    planes = MetaPlanes.for_method(method, hkv, n, d, dtype)
    slots = hkv + (planes.num_slots if planes else 0)
    cache = (randn(num_blocks, slots, n, 2 * d, g=g) * 4 + 1).to(dtype)
    return cache, planes


def _twin(cache, planes, hkv, key, value, slots):
    layout = PageLayout.of(cache, hkv, "interleaved")
    write_kv_reference(layout, cache, key, value, slots)
    if planes is not None:
        meta = planes.views(cache)
        if meta.kmin is not None:
            write_page_minmax(layout, cache, meta, slots)
        if meta.codes is not None:
            write_int4_shadow(meta, key, slots, layout.page_size, cache.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


@in_process
@pytest.mark.parametrize("method", ["quoka", "quest", "twilight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,n,d", [(2, 4, 16), (1, 16, 32), (3, 16, 64)])
def test_decode_write_matches_generic_writers(method, dtype, hkv, n, d):
    g = gen(hash((method, str(dtype), hkv, n, d)) % 10_000)
    num_blocks, reqs = 12, 7
    cache, planes = _cache(method, hkv, n, d, dtype, num_blocks, g)
    blocks = torch.randperm(num_blocks, generator=g)[:reqs]  # each request's own last page
    offsets = torch.randint(0, n, (reqs,), generator=g)
    offsets[0], offsets[1] = 0, n - 1  # a fresh page and a page's last slot
    slots = blocks * n + offsets
    slots = torch.cat([slots[:3], torch.tensor([-1]), slots[3:], torch.tensor([-1, -1])])  # CUDA-graph padding
    key = randn(len(slots) + 2, hkv, d, g=g) * 3  # float32 rows, padded past the slot mapping
    value = randn(len(slots) + 2, hkv, d, g=g)
    want = cache.clone()
    _twin(want, planes, hkv, key, value, slots)
    got = cache.to(DEVICE)
    meta = planes.views(got) if planes is not None else None
    layout = PageLayout.of(got, hkv, "interleaved")
    write_decode_step_triton(layout, got, meta, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(_bytes(got), _bytes(want))


@in_process
def test_consecutive_decode_steps_keep_the_page_summary():
    """Token after token into one page: the fused writer's min/max equals the twin's at every step."""
    g = gen(5)
    hkv, n, d = 2, 8, 16
    cache, planes = _cache("twilight", hkv, n, d, torch.bfloat16, 4, g)
    want, got = cache.clone(), cache.to(DEVICE)
    layout = PageLayout.of(got, hkv, "interleaved")
    for offset in range(n):
        slots = torch.tensor([2 * n + offset, n + offset])
        key, value = randn(2, hkv, d, g=g) * 2, randn(2, hkv, d, g=g)
        _twin(want, planes, hkv, key, value, slots)
        write_decode_step_triton(layout, got, planes.views(got), key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE))
        assert torch.equal(_bytes(got), _bytes(want)), offset


def test_decode_write_rejects_planes_order():
    cache = torch.zeros(2, 1, 4, 16)
    with pytest.raises(ValueError, match="interleaved"):
        write_decode_step_triton(
            PageLayout.of(cache, 1, "planes"), cache, None, cache[0, 0], cache[0, 0], torch.zeros(1)
        )
