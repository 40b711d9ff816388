"""The README's support matrix, as the backends declare it to vLLM: what each backend accepts and
what vLLM refuses at engine start (vLLM turns every ``supports_*`` False into an invalid reason)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheLayout  # noqa: E402

from vllm_sparse.backend import backends  # noqa: E402
from vllm_sparse.backend.metadata import SparseMetadataBuilder  # noqa: E402

IMPLEMENTED = [
    backends.SparseQuokaBackend,
    backends.SparseQuestBackend,
    backends.SparseTwilightBackend,
    backends.SparseKascadeBackend,
]


@pytest.mark.parametrize("backend", IMPLEMENTED, ids=lambda b: b.get_name())
def test_dtypes_and_kv_cache_dtypes(backend, monkeypatch):
    assert backend.supports_dtype(torch.bfloat16) and backend.supports_dtype(torch.float16)
    assert backend.supports_kv_cache_dtype("auto") and backend.supports_kv_cache_dtype("bfloat16")
    for fp8 in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert not backend.supports_kv_cache_dtype(fp8), "fp8 KV caches are refused at start"
    monkeypatch.setattr(backends.current_platform, "is_cpu", lambda: True)
    assert backend.supports_dtype(torch.float32)
    monkeypatch.setattr(backends.current_platform, "is_cpu", lambda: False)
    assert not backend.supports_dtype(torch.float32), "GPU executors run 16-bit types only"


@pytest.mark.parametrize("backend", IMPLEMENTED, ids=lambda b: b.get_name())
def test_head_sizes_pages_and_architectures(backend, monkeypatch):
    monkeypatch.setattr(backends.current_platform, "is_cpu", lambda: False)
    assert [h for h in (32, 64, 80, 96, 128, 256) if backend.supports_head_size(h)] == [64, 128, 256]
    monkeypatch.setattr(backends.current_platform, "is_cpu", lambda: True)
    assert backend.supports_head_size(80), "CPU: any head size (vLLM's CPU kernel or the torch reference)"
    (block,) = backend.get_supported_kernel_block_sizes()
    assert block.base == 16
    assert backend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)

    class Cap:
        def __init__(self, major):
            self.major = major

    assert backend.supports_compute_capability(Cap(8)) and backend.supports_compute_capability(Cap(9))
    assert not backend.supports_compute_capability(Cap(7)), "Volta and older are refused"


def test_cuda_graph_support_is_declared_per_platform(monkeypatch):
    from vllm_sparse.backend import metadata

    monkeypatch.setattr(metadata, "device_decode_supported", lambda cfg: True)
    assert SparseMetadataBuilder.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    monkeypatch.setattr(metadata, "device_decode_supported", lambda cfg: False)
    assert SparseMetadataBuilder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER


@pytest.mark.parametrize("block,refused", [(16, False), (32, False), (48, True)])
def test_twilight_refuses_page_sizes_that_are_not_powers_of_two(block, refused):
    from types import SimpleNamespace

    from vllm_sparse.backend.startup import sparse_config_reasons

    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=block), additional_config={}, model_config=None)
    reasons = sparse_config_reasons("twilight", cfg)
    assert any("power-of-two block size" in r for r in reasons) is refused, reasons
    assert not any("power-of-two" in r for r in sparse_config_reasons("quest", cfg))
