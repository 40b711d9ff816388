"""Bad input, engine flags (issue 15 item 4): ``--enforce-eager`` and every ``cudagraph_mode`` build
an engine config with each sparse backend without error. CPUs have no CUDA graphs: vLLM's CPU
platform turns every mode into NONE, and the sparse builder declares NEVER there."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import CompilationConfig, set_current_vllm_config  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402

from vllm_sparse.backend.metadata import SparseMetadataBuilder  # noqa: E402
from vllm_sparse.backend.startup import sparse_config_reasons  # noqa: E402
from vllm_sparse.plugin import register  # noqa: E402

register()


@pytest.mark.parametrize("method", ["quoka", "quest", "twilight", "kascade"])
@pytest.mark.parametrize("eager", [True, False], ids=["enforce_eager", "graphs_asked"])
@pytest.mark.parametrize("mode", list(CUDAGraphMode), ids=lambda m: m.name)
def test_every_cudagraph_mode_and_enforce_eager_configure_cleanly(tiny_llama, method, eager, mode):
    if not current_platform.is_cpu():
        pytest.skip("CUDA graphs on GPUs: tests/gpu")
    extra = {"sparse_attention": {"kascade": {"anchors": [0, 2]}}} if method == "kascade" else {}
    args = EngineArgs(
        model=tiny_llama, attention_backend=f"sparse_{method}", enforce_eager=eager, dtype="float32",
        block_size=32, max_model_len=2048, additional_config=extra,
        compilation_config=CompilationConfig(cudagraph_mode=mode),
    )  # fmt: skip
    cfg = args.create_engine_config()
    assert cfg.attention_config.backend.name == f"SPARSE_{method.upper()}"
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE, "no CUDA graphs on CPUs"
    with set_current_vllm_config(cfg):
        assert sparse_config_reasons(method, cfg) == []
        assert SparseMetadataBuilder.get_cudagraph_support(cfg, None) == AttentionCGSupport.NEVER
