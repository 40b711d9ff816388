"""Engine-start checks and config loading from a ``VllmConfig`` (the only vLLM-aware config code)."""

from __future__ import annotations

import functools
import json
import logging
import os

from vllm_sparse.config import ENV_VAR, ResolvedConfig, SparseConfigError, resolve_config
from vllm_sparse.selectors import IMPLEMENTED_METHODS

logger = logging.getLogger("vllm_sparse")


def _model_name(vllm_config) -> str | None:
    mc = getattr(vllm_config, "model_config", None)
    return None if mc is None else mc.model


@functools.lru_cache(maxsize=32)
def _resolve_cached(method: str, model: str | None, additional_json: str, env_path: str | None) -> ResolvedConfig:
    environ = {ENV_VAR: env_path} if env_path else {}
    resolved = resolve_config(method, model, json.loads(additional_json), environ)
    logger.info("vllm-sparse: sparse_%s config from %s: %s", method, resolved.source, resolved.config.model_dump())
    return resolved


def load_config(method: str, vllm_config) -> ResolvedConfig:
    """The resolved selector config for ``method`` (raises ``SparseConfigError``)."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    return _resolve_cached(
        method, _model_name(vllm_config), json.dumps(additional, sort_keys=True, default=str), os.environ.get(ENV_VAR)
    )


def sparse_config_reasons(method: str, vllm_config) -> list[str]:
    """Every reason ``method`` cannot run with this engine config, vLLM ``invalid_reasons`` style."""
    reasons = []
    if method not in IMPLEMENTED_METHODS:
        implemented = ", ".join(f"sparse_{m}" for m in IMPLEMENTED_METHODS)
        reasons.append(f"sparse_{method} is not implemented yet in vllm-sparse (implemented: {implemented})")
    try:
        cfg = load_config(method, vllm_config).config
    except SparseConfigError as e:  # still report the engine's other problems below
        cfg = None
        reasons += [f"config ({e.source}): {r}" for r in e.reasons]
    if getattr(vllm_config, "speculative_config", None) is not None:
        reasons.append(
            "speculative decoding is not supported: sparse decode rows are planned from exact sequence "
            "lengths, which the host does not know while drafts await verification"
        )
    block = getattr(getattr(vllm_config, "cache_config", None), "block_size", None)
    if method == "twilight" and block and block & (block - 1):
        reasons.append(f"sparse_twilight needs a power-of-two block size for its INT4 key shadows (got {block})")
    mc = getattr(vllm_config, "model_config", None)
    hkv = mc.get_total_num_kv_heads() if mc is not None else None
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    if mc is not None and cfg is not None:
        reasons += [f"config: {r}" for r in cfg.model_reasons(mc.get_total_num_hidden_layers(), hkv, tp)]
    if method == "compact" and cfg is not None:
        hq = getattr(getattr(mc, "model_arch_config", None), "total_num_attention_heads", None)
        if hq and hkv and tp > 1:  # a worker's own query and KV heads (KV heads replicated past hkv ranks)
            hq, hkv = hq // tp, max(1, hkv // tp)
        reasons += [f"config: {r}" for r in cfg.compact.engine_reasons(cfg.asks_sparse_decode(), hq, hkv)]
    return reasons
