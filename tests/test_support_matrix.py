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
    backends.SparseCompactBackend,
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


@pytest.mark.parametrize("backend", IMPLEMENTED, ids=lambda b: b.get_name())
def test_preferred_page_size_per_platform(backend, monkeypatch):
    """Quest and Twilight ask vLLM for pages of 32 on GPUs (half the page bounds to read and rank per
    decode step); the other methods, and every method on CPUs, keep vLLM's default, and ``--block-size`` wins."""
    monkeypatch.setattr(backends.current_platform, "is_cuda", lambda: True)
    expected = 32 if backend in (backends.SparseQuestBackend, backends.SparseTwilightBackend) else 16
    assert backend.get_preferred_block_size(16) == expected
    assert backend.get_preferred_block_size(64) == 64, "never smaller than the default it is given"
    assert backend.supports_block_size(backend.get_preferred_block_size(16))
    monkeypatch.setattr(backends.current_platform, "is_cuda", lambda: False)
    assert backend.get_preferred_block_size(16) == 16


def test_impl_reads_the_block_size_vllm_settles_after_building_the_model():
    """vLLM builds the layers, then sets the block size a backend prefers: the impl (its warm-up,
    scratch cache, executors) must see the settled size, not the one at construction."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config

    cfg = VllmConfig(cache_config=CacheConfig(block_size=16))
    with set_current_vllm_config(cfg):
        impl = backends.SparseQuestBackend.get_impl_cls()(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2)
    assert impl.block_size == 16
    cfg.cache_config.block_size = 32  # what update_block_size_for_backend does after load_model
    assert impl.block_size == 32
    assert impl.execute is impl.execute, "the executor is picked once"


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


def test_engine_problems_reported_beside_a_bad_selector_config():
    from types import SimpleNamespace

    from vllm_sparse.backend.startup import sparse_config_reasons

    cfg = _engine(block=48, sparse_attention={"sink_tokens": -1, "bogus": 1})
    cfg.speculative_config = SimpleNamespace(method="ngram")
    reasons = sparse_config_reasons("twilight", cfg)
    assert [r.split(":")[0] for r in reasons] == [
        "config (--additional-config sparse_attention)", "config (--additional-config sparse_attention)",
        "speculative decoding is not supported", "sparse_twilight needs a power-of-two block size for its INT4 key shadows (got 48)",
    ], reasons  # fmt: skip


# --------------------------------------------------------------------------------------------
# Bad models and engine flags refused at start, every reason at once (issue 15 item 4)
# --------------------------------------------------------------------------------------------


def _engine(block=32, sparse_attention=None):
    from types import SimpleNamespace

    extra = {} if sparse_attention is None else {"sparse_attention": sparse_attention}
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block), additional_config=extra, model_config=None,
        speculative_config=None,
    )  # fmt: skip


def _selector(**kw) -> dict:
    """vLLM's selector arguments (its defaults for everything not given)."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(**kw)._asdict()


EVERY_PROBLEM = dict(
    head_size=80, dtype=torch.float32, kv_cache_dtype="fp8", block_size=24, use_mla=True,
    has_sink=True, has_sliding_window=True,
)  # fmt: skip
# vLLM's reason -> what our explanation must add to it
EXPLAINED = {
    "head_size not supported": ["head size 80", "64, 128, 256"],
    "dtype not supported": ["torch.float32", "--dtype bfloat16"],
    "kv_cache_dtype not supported": ["'fp8'", "drop --kv-cache-dtype"],
    "block_size not supported": ["block size 24", "multiple of 16"],
    "MLA not supported": ["latent attention"],
    "sliding window not supported": ["sliding-window"],
    "attention sinks not supported": ["sink"],
}


def test_kascade_head_map_crossing_tensor_parallel_ranks_refused_at_start():
    """A calibrated head map whose reuse heads read anchor heads of another rank cannot run with
    tensor parallelism: refused at engine start with the layer and heads, beside the other reasons."""
    from types import SimpleNamespace

    from vllm_sparse.backend.startup import sparse_config_reasons

    model = SimpleNamespace(model="m", get_total_num_kv_heads=lambda: 2, get_total_num_hidden_layers=lambda: 4)
    engine = _engine(sparse_attention={"kascade": {"anchors": [0, 2], "head_map": {"1": [1, 0]}}})
    engine.model_config = model
    engine.parallel_config = SimpleNamespace(tensor_parallel_size=1)
    assert [r for r in sparse_config_reasons("kascade", engine) if "head_map" in r] == []
    engine.parallel_config = SimpleNamespace(tensor_parallel_size=2)
    engine.speculative_config = SimpleNamespace(method="ngram")
    reasons = sparse_config_reasons("kascade", engine)
    assert any("head_map.1 = [1, 0]" in r and "0->1, 1->0" in r for r in reasons), reasons
    assert any("speculative decoding" in r for r in reasons), reasons  # every reason at once


@pytest.mark.parametrize("backend", IMPLEMENTED, ids=lambda b: b.get_name())
def test_every_bad_model_property_refused_at_once_with_the_fix(backend, monkeypatch):
    monkeypatch.setattr(backends.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(backends, "get_current_vllm_config", lambda: _engine(sparse_attention={"sink_tokens": -1}))
    reasons = backend.validate_configuration(device_capability=None, **_selector(**EVERY_PROBLEM))
    for vllm_reason, needles in EXPLAINED.items():
        line = [r for r in reasons if r.startswith(vllm_reason)]
        assert len(line) == 1 and all(n in line[0] for n in needles), (vllm_reason, reasons)
    assert any("sink_tokens = -1" in r for r in reasons), reasons  # the selector config's reasons too
    assert len(reasons) == len(EXPLAINED) + 1, reasons


@pytest.mark.parametrize("problem", sorted(EXPLAINED))
def test_each_bad_model_property_alone_gives_one_reason(problem, monkeypatch):
    monkeypatch.setattr(backends.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(backends, "get_current_vllm_config", lambda: _engine())
    good = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=32)
    key = {
        "head_size not supported": "head_size", "dtype not supported": "dtype",
        "kv_cache_dtype not supported": "kv_cache_dtype", "block_size not supported": "block_size",
        "MLA not supported": "use_mla", "sliding window not supported": "has_sliding_window",
        "attention sinks not supported": "has_sink",
    }[problem]  # fmt: skip
    backend = backends.SparseQuestBackend
    assert backend.validate_configuration(device_capability=None, **_selector(**good)) == []
    reasons = backend.validate_configuration(device_capability=None, **_selector(**{**good, key: EVERY_PROBLEM[key]}))
    assert len(reasons) == 1 and reasons[0].startswith(problem), reasons


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_refused_on_cpu_through_the_platform_hook(kv_cache_dtype, monkeypatch):
    """The CPU platform hook (plugin.py) raises vLLM's error with every reason, one per line."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from vllm_sparse.plugin import register

    if not current_platform.is_cpu():
        pytest.skip("the hook patches vLLM's CPU platform")
    register()
    monkeypatch.setattr(backends, "get_current_vllm_config", lambda: _engine(block=48))
    selector = AttentionSelectorConfig(
        head_size=64, dtype=torch.float32, kv_cache_dtype=kv_cache_dtype, block_size=48, use_mla=True,
        has_sliding_window=True,
    )  # fmt: skip
    with pytest.raises(ValueError) as e:
        current_platform.get_attn_backend_cls(AttentionBackendEnum["SPARSE_TWILIGHT"], selector)
    lines = str(e.value).splitlines()
    assert "SPARSE_TWILIGHT is not valid" in lines[0]
    for needle in (
        f"'{kv_cache_dtype}'",
        "MLA not supported",
        "sliding window",
        "power-of-two block size for its INT4 key shadows (got 48)",
    ):
        assert sum(needle in line for line in lines) == 1, (needle, lines)
    assert len(lines) == 1 + 4, lines  # the header and one line per reason
    ok = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=32)
    monkeypatch.setattr(backends, "get_current_vllm_config", lambda: _engine(block=32))
    assert current_platform.get_attn_backend_cls(AttentionBackendEnum["SPARSE_TWILIGHT"], ok).endswith(
        "SparseTwilightBackend"
    )


@pytest.mark.parametrize(
    "kwargs,needles",
    [
        (dict(alibi_slopes=[0.5] * 8), ["ALiBi"]),
        (dict(logits_soft_cap=30.0), ["logits soft cap"]),
        (dict(sliding_window=256), ["sliding window"]),
        (
            dict(alibi_slopes=[0.5] * 8, logits_soft_cap=50.0, sliding_window=128),
            ["ALiBi", "logits soft cap", "sliding window"],
        ),
    ],
)
@pytest.mark.parametrize("impl", ["SparseQuokaImpl", "SparseQuestImpl", "SparseTwilightImpl", "SparseKascadeImpl"])
def test_alibi_soft_cap_and_sliding_window_refused_by_the_layer(impl, kwargs, needles):
    """ALiBi and logit soft-caps are not in vLLM's backend selection: the layer refuses them when built."""
    from vllm_sparse.backend import impl as impl_mod

    cls = getattr(impl_mod, impl)
    with pytest.raises(NotImplementedError) as e:
        cls(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2, **kwargs)
    assert f"sparse_{cls.method} does not support" in str(e.value)
    assert all(n in str(e.value) for n in needles), str(e.value)


@pytest.mark.parametrize("method", ["quoka", "quest", "twilight", "kascade", "compact"])
@pytest.mark.parametrize("block", [16, 24, 48, 64])
def test_page_sizes_each_method_cannot_use(method, block):
    """Pages: a multiple of 16 tokens for every method (vLLM's block-size check), a power of two for Twilight."""
    backend = {b.method: b for b in IMPLEMENTED}[method]
    from vllm_sparse.backend.startup import sparse_config_reasons

    assert backend.supports_block_size(block) is (block % 16 == 0)
    power_of_two = not block & (block - 1)
    reasons = sparse_config_reasons(method, _engine(block=block, sparse_attention={"kascade": {"anchors": [0]}}))
    refused = any(f"power-of-two block size for its INT4 key shadows (got {block})" in r for r in reasons)
    assert refused is (method == "twilight" and not power_of_two), reasons
