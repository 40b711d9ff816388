"""Backend classes: one per method, capabilities declared as class methods (vLLM v1 style).

``get_name()`` must return the registered enum name (``SPARSE_QUOKA``...): vLLM's ``Attention``
layer looks itself up with it. Methods not implemented yet still register, so that selecting
them fails at engine start with a clear reason instead of running dense silently.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.kv_cache_interface import KVCacheLayout

from vllm_sparse.backend.impl import (
    SparseAttentionImpl,
    SparseCompactImpl,
    SparseKascadeImpl,
    SparseQuestImpl,
    SparseQuokaImpl,
    SparseTwilightImpl,
)
from vllm_sparse.backend.metadata import SparseMetadataBuilder
from vllm_sparse.backend.startup import sparse_config_reasons
from vllm_sparse.layout import MetaPlanes


class SparseBackend(AttentionBackend):
    method: ClassVar[str]
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16"]
    gpu_page_tokens: ClassVar[int | None] = None  # preferred page size on GPUs (None: vLLM's default)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        """float32 on CPUs only: the GPU executors (FlashInfer, FlashAttention) run 16-bit types."""
        if dtype == torch.float32 and not current_platform.is_cpu():
            return False
        return dtype in cls.supported_dtypes

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """The page size vLLM gives this backend when ``--block-size`` is not passed: ``gpu_page_tokens``
        on GPUs where the method sets one (vLLM's default elsewhere)."""
        if cls.gpu_page_tokens and current_platform.is_cuda():
            return max(default_block_size, cls.gpu_page_tokens)
        return super().get_preferred_block_size(default_block_size)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [] if current_platform.is_cpu() else [64, 128, 256]

    @classmethod
    def meta_slots(cls, spec) -> int:
        """Extra head slots per block for this method's page metadata (0: none).

        A function of the method and the layer's shapes only, so the engine core and every
        worker agree on the page size (see ``layout.MetaPlanes``).
        """
        planes = MetaPlanes.for_method(cls.method, spec.num_kv_heads, spec.block_size, spec.head_size, spec.dtype)
        return 0 if planes is None else planes.num_slots

    @classmethod
    def customize_spec(cls, spec):
        """Metadata methods get ``num_head_slots = num_kv_heads + meta_slots``: vLLM's memory
        planner, prefix caching, block copies and offload then count and move the planes with
        their pages."""
        spec = super().customize_spec(spec)
        if spec.num_head_slots is None and (extra := cls.meta_slots(spec)):
            spec = dataclasses.replace(spec, num_head_slots=spec.num_kv_heads + extra)
        return spec

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # head-major: one (block, KV head) is one contiguous page

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability is None or capability.major >= 8

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        """vLLM's checks, each with what was asked and what would work, plus ours (method
        implemented, selector config valid for the model)."""
        reasons = super().validate_configuration(*args, **kwargs)
        asked = inspect.signature(AttentionBackend.validate_configuration).bind(*args, **kwargs).arguments
        return [cls.explain(r, asked) for r in reasons] + sparse_config_reasons(cls.method, get_current_vllm_config())

    @classmethod
    def explain(cls, reason: str, asked: dict) -> str:
        """One of vLLM's terse reasons ("head_size not supported"), with the value and the fix."""
        name = f"sparse_{cls.method}"
        details = {
            "head_size not supported": lambda: (
                f"head size {asked.get('head_size')}; {name} on GPUs runs "
                f"{', '.join(map(str, cls.get_supported_head_sizes()))}"
            ),
            "dtype not supported": lambda: (
                f"{asked.get('dtype')}; {name} runs float16 or bfloat16 (float32 on CPUs only): pass --dtype bfloat16"
            ),
            "kv_cache_dtype not supported": lambda: (
                f"{asked.get('kv_cache_dtype')!r}; {name} selects pages "
                f"from full-precision keys ({', '.join(cls.supported_kv_cache_dtypes)}): drop --kv-cache-dtype"
            ),
            "block_size not supported": lambda: (
                f"block size {asked.get('block_size')}; {name} pages must "
                "be a multiple of 16 tokens: pass --block-size 16, 32 or 64"
            ),
            "MLA not supported": lambda: (
                f"{name} attends over per-head keys; MLA (latent attention, DeepSeek-style) models are not supported"
            ),
            "sliding window not supported": lambda: (
                f"{name} selects from the whole context; use a model without sliding-window layers"
            ),
            "attention sinks not supported": lambda: f"{name} does not add learned sink logits",
            "compute capability not supported": lambda: f"{name} needs compute capability 8.0 or newer",
        }
        detail = details.get(reason)
        return f"{reason}: {detail()}" if detail else f"{reason} ({name})"

    @staticmethod
    def get_builder_cls() -> type[SparseMetadataBuilder]:
        return SparseMetadataBuilder


class SparseQuokaBackend(SparseBackend):
    method = "quoka"

    @staticmethod
    def get_name() -> str:
        return "SPARSE_QUOKA"

    @staticmethod
    def get_impl_cls() -> type[SparseAttentionImpl]:
        return SparseQuokaImpl


class SparseQuestBackend(SparseBackend):
    method = "quest"
    # pages of 32 halve the page bounds a decode step reads and ranks (TPOT after 130K 0.706x -> 0.654x
    # FLASH_ATTN's), with the same answers on the 1.5B model (``benchmarks/results/serve_bench_h100_session22/``)
    gpu_page_tokens = 32

    @staticmethod
    def get_name() -> str:
        return "SPARSE_QUEST"

    @staticmethod
    def get_impl_cls() -> type[SparseAttentionImpl]:
        return SparseQuestImpl


class SparseTwilightBackend(SparseBackend):
    method = "twilight"
    # pages of 32 decode faster (TPOT after 130K 0.789x -> 0.745x FLASH_ATTN's, decode at 16 x 16K 1.36x -> 1.42x;
    # ``benchmarks/results/serve_bench_h100_session23/``) with the same answers on both Qwen models, paired with pages
    # of 16 on the same prompts: +0.00 / +0.01 (0.5B), +0.01 / +0.01 (1.5B) at 16K / 32K
    # (``benchmarks/results/eval_qwen_gpu_session24/``)
    gpu_page_tokens = 32

    @staticmethod
    def get_name() -> str:
        return "SPARSE_TWILIGHT"

    @staticmethod
    def get_impl_cls() -> type[SparseAttentionImpl]:
        return SparseTwilightImpl


class SparseKascadeBackend(SparseBackend):
    method = "kascade"

    @staticmethod
    def get_name() -> str:
        return "SPARSE_KASCADE"

    @staticmethod
    def get_impl_cls() -> type[SparseAttentionImpl]:
        return SparseKascadeImpl


class SparseCompactBackend(SparseBackend):
    method = "compact"

    @staticmethod
    def get_name() -> str:
        return "SPARSE_COMPACT"

    @staticmethod
    def get_impl_cls() -> type[SparseAttentionImpl]:
        return SparseCompactImpl
