"""The JIT trace hook logs compilations of our kernels only, and chains to the previous hook."""

from __future__ import annotations

import logging
import types

import pytest

triton = pytest.importorskip("triton")


def test_trace_logs_our_kernels_and_chains(monkeypatch, caplog):
    from triton import knobs

    from vllm_sparse.kernels import jit_trace

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["fn"].name))
    monkeypatch.setattr(jit_trace, "_installed", False)
    monkeypatch.setenv("VLLM_SPARSE_JIT_TRACE", "1")
    assert jit_trace.install_if_asked()
    logger = logging.getLogger("vllm_sparse")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger="vllm_sparse"):
        for module, name in (("vllm_sparse.kernels.page_tables", "_fill"), ("vllm.other", "_theirs")):
            fn = types.SimpleNamespace(module=module, name=name)
            knobs.runtime.jit_post_compile_hook(fn=fn, repr=f"{name}(x: i32D)", compile={"constants": {"B": 16}})
    assert seen == ["_fill", "_theirs"]
    traced = [r.getMessage() for r in caplog.records if "JIT" in r.getMessage()]
    # ours is logged, vLLM's is not (a record may reach caplog twice when an earlier test in the
    # process configured vLLM's loggers: count kinds, not records)
    assert traced and all("_fill(x: i32D)" in m and "'B': 16" in m for m in traced), traced


def test_trace_is_off_by_default(monkeypatch):
    from vllm_sparse.kernels import jit_trace

    monkeypatch.setattr(jit_trace, "_installed", False)
    monkeypatch.delenv("VLLM_SPARSE_JIT_TRACE", raising=False)
    assert not jit_trace.install_if_asked()
