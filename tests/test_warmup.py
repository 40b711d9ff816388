"""The start-up warm-up of the sparse prefill path: it runs the layer's selection and executor on
sparse synthetic chunks, and leaves the cache as it was."""

from __future__ import annotations

import pytest
import torch
from helpers import make_paged_batch, single_thread  # noqa: F401  (autouse fixture)

from vllm_sparse.config import SparseConfig
from vllm_sparse.executors import reference_executor
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.selectors import make_selector
from vllm_sparse.warmup import WARMUP_CHUNKS, warm_up_prefill


@pytest.mark.parametrize("method", ["quoka", "quest", "twilight"])
def test_warm_up_runs_sparse_chunks_and_writes_no_cache(method):
    hkv, group, n, d = 2, 2, 16, 32
    planes = MetaPlanes.for_method(method, hkv, n, d, torch.float32)
    batch = make_paged_batch([700], hkv, n, d, meta_slots=planes.num_slots if planes else 0, seed=1)
    layout = PageLayout.of(batch.kv_cache, hkv, "planes")
    meta = planes.views(batch.kv_cache) if planes else None
    cfg = SparseConfig(method=method, dense_layers=[0])
    policy = cfg.for_layer(0)  # a dense layer: warmed as if sparse
    selector = make_selector(cfg, d**-0.5)
    calls = []

    widths = []

    def counting_selector(*args):
        calls.append(args[4])
        widths.append(args[2].stride(0))
        return selector(*args)

    before = batch.kv_cache.clone()
    warm_up_prefill(
        counting_selector, reference_executor, policy, layout, layout.page_keys(batch.kv_cache),
        layout.page_values(batch.kv_cache), meta, hkv * group, d**-0.5, torch.float32, 4096,
    )  # fmt: skip
    assert torch.equal(batch.kv_cache, before)
    assert len(calls) == len(WARMUP_CHUNKS) and all(plan.any_sparse for plan in calls)
    assert widths == [4096] * len(WARMUP_CHUNKS), "block tables must have the engine's row stride"

