"""``VLLM_SPARSE_JIT_TRACE=1``: log every compilation of a vllm_sparse Triton kernel with the
specialisation it was compiled for (argument types, which integers divide by 16, constexprs).

A diagnosis aid for the start-up warm-up (``vllm_sparse.warmup``): when vLLM's JIT monitor reports
one of our kernels compiled during inference, the two log lines of that kernel (warm-up and
request) show which argument's specialisation differed. Chains to any hook already installed, and
vLLM's monitor chains to this one.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm_sparse")
_installed = False


def install_if_asked() -> bool:
    """Install the hook when ``VLLM_SPARSE_JIT_TRACE`` is set (idempotent); whether it is active."""
    global _installed
    if _installed or os.environ.get("VLLM_SPARSE_JIT_TRACE", "0") in ("", "0"):
        return _installed
    try:
        from triton import knobs
    except ImportError:
        return False
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        fn = kwargs.get("fn")
        if "vllm_sparse" in str(getattr(fn, "module", "")):
            constants = (kwargs.get("compile") or {}).get("constants")
            logger.info("vllm-sparse JIT %s constants=%s", kwargs.get("repr") or kwargs.get("key"), constants)
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    _installed = True
    return True
