"""Dense decode rows at FLASH_ATTN's cost: the decode block of layers whose policy decodes every row dense
(``LayerPolicy.decodes_dense``: QuoKA's default, dense layers, compact, ``sparse_decode: false`` layers) through
vLLM's FlashAttention 3, the call the FLASH_ATTN backend makes for a decode batch, reading the head-major cache in
place through its strided NHD view (``dense_prefill.cache_kv_nhd``).

CUDA graphs, as vLLM's FlashAttention backend does them: the builder plans each step outside the graph
(``DenseDecode.plan``: FA3's scheduler metadata for the step's lengths, written into one persistent buffer, and a
fixed split count for the batch sizes vLLM captures), and the captured call reads the lengths (vLLM's own
``seq_lens`` buffer) and that metadata at fixed addresses, so a graph replays for any lengths. One plan per step
serves every layer of the group. ``kernels.decode_attention.decode_attention_reference`` is the twin (dense
columns: every page of every row), and ``kernels.decode_attention.decode_attention_triton`` the path it replaces.

``VLLM_SPARSE_DENSE_DECODE=triton`` keeps the Triton decode kernel for these rows (A/B runs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_sparse.backend.dense_prefill import cache_kv_nhd, flash_attn_version

logger = logging.getLogger("vllm_sparse")

DENSE_DECODE_ENV = "VLLM_SPARSE_DENSE_DECODE"
KERNELS = ("flash", "triton")


def kernel_switch(name: str, kernels: tuple[str, ...], environ=os.environ) -> str:
    """The decode kernel that environment variable ``name`` picks among ``kernels`` (the first when unset or empty;
    case and spaces ignored); anything else is refused."""
    text = (environ.get(name) or kernels[0]).strip().lower()
    if text not in kernels:
        raise ValueError(f"{name}={text!r}: expected one of {', '.join(kernels)}")
    return text


def dense_decode_kernel(environ=os.environ) -> str:
    """``VLLM_SPARSE_DENSE_DECODE``: ``flash`` (default, also when empty) or ``triton``."""
    return kernel_switch(DENSE_DECODE_ENV, KERNELS, environ)


@dataclass(frozen=True)
class DenseDecodePlan:
    """One step's FlashAttention decode call, shared by every dense-decoding layer of the group.

    Attributes:
        num_reqs: ``B`` decode requests (CUDA-graph padding included; padding rows have length 0).
        seq_lens: ``int32 [B]`` context + 1 of each row (vLLM's persistent buffer, device).
        cu_seqlens_q: ``int32 [B + 1]`` ``0 .. B`` (one query token a request; persistent).
        scheduler: ``int32 [M]`` FA3's scheduler metadata for these lengths (a view of a persistent
            buffer), or None (FA3 schedules on its own: batches past the captured sizes).
        max_seq_len: the longest row (host; FA3 reads the lengths on the device).
        num_splits: splits per row (fixed for captured batch sizes, 0: FA3's own choice).
        attend: vLLM's ``flash_attn_varlen_func``.
    """

    attend: Callable
    num_reqs: int
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    scheduler: torch.Tensor | None
    max_seq_len: int
    num_splits: int


class DenseDecode:
    """Plans, in the builder, the FlashAttention decode of dense rows that each layer runs (``run_dense_decode``).

    ``create`` returns None where vLLM ships no FlashAttention 3 for these shapes (the Triton decode
    kernel then runs these rows, as before).
    """

    def __init__(
        self, num_heads_q: int, num_heads_kv: int, head_size: int, page_size: int, kv_dtype: torch.dtype,
        max_reqs: int, max_graph_batch: int, max_splits: int, device: torch.device, attend: Callable | None = None,
        schedule: Callable | None = None,
    ):  # fmt: skip
        """attend, schedule: vLLM's ``flash_attn_varlen_func`` and ``get_scheduler_metadata`` (default; a CPU test
        passes torch twins)."""
        if attend is None or schedule is None:
            from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

            attend, schedule = attend or flash_attn_varlen_func, schedule or get_scheduler_metadata
        self._attend, self._schedule = attend, schedule
        self.num_heads_q, self.num_heads_kv, self.head_size = num_heads_q, num_heads_kv, head_size
        self.page_size, self.kv_dtype = page_size, kv_dtype
        self.max_graph_batch, self.max_splits = max_graph_batch, max_splits
        rows = max(max_reqs, max_graph_batch)
        self._cu_q = torch.arange(rows + 1, dtype=torch.int32, device=device)
        # FA3's scheduler metadata: 1 + round_up(batch, 4) * 4 entries (as vLLM's FlashAttention backend sizes it)
        self._scheduler = torch.zeros(1 + -(-rows // 4) * 4 * 4, dtype=torch.int32, device=device)

    @classmethod
    def create(
        cls, num_heads_q: int, num_heads_kv: int, head_size: int, page_size: int, kv_dtype: torch.dtype,
        max_reqs: int, max_graph_batch: int, max_splits: int, device: torch.device,
    ) -> DenseDecode | None:  # fmt: skip
        if dense_decode_kernel() != "flash" or flash_attn_version(head_size, page_size) != 3:
            return None
        try:
            return cls(num_heads_q, num_heads_kv, head_size, page_size, kv_dtype, max_reqs, max_graph_batch,
                       max_splits, device)  # fmt: skip
        except ImportError as e:
            logger.info("vllm-sparse: dense decode rows stay on the Triton kernel (%s)", e)
            return None

    def plan(self, seq_lens: torch.Tensor, max_seq_len: int) -> DenseDecodePlan:
        """Host work of one step, outside any graph: FA3's scheduler metadata for these lengths.

        Args:
            seq_lens: ``int32 [B]`` the decode rows' lengths on the device (vLLM's buffer).
            max_seq_len: their maximum (host).
        """
        b = seq_lens.shape[0]
        splits = self.max_splits if b <= self.max_graph_batch else 0
        meta = self._schedule(
            batch_size=b, max_seqlen_q=1, max_seqlen_k=max(1, max_seq_len), num_heads_q=self.num_heads_q,
            num_heads_kv=self.num_heads_kv, headdim=self.head_size, cache_seqlens=seq_lens, qkv_dtype=self.kv_dtype,
            cu_seqlens_q=self._cu_q[: b + 1], page_size=self.page_size, causal=True, num_splits=splits,
        )  # fmt: skip
        n = meta.shape[0]
        scheduler = None
        if n <= self._scheduler.shape[0]:  # into the persistent buffer (zeros past it, as vLLM does)
            self._scheduler[:n] = meta
            self._scheduler[n:] = 0
            scheduler = self._scheduler[:n]
        return DenseDecodePlan(self._attend, b, seq_lens, self._cu_q[: b + 1], scheduler, max_seq_len, splits)


def run_dense_decode(
    plan: DenseDecodePlan, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    block_table: torch.Tensor, scale: float, output: torch.Tensor,
) -> None:  # fmt: skip
    """One layer's dense decode rows through vLLM's FlashAttention, as the step's plan says.

    Args:
        plan: the step's plan (``DenseDecode.plan``, made by the builder).
        query, output: ``[B, Hq, D]`` the decode block.
        keys, values: ``[num_blocks, Hkv, N, D]`` strided views of the cache (head-major).
        block_table: ``int32 [B, max_blocks]`` the decode requests' block-table rows.
    Every row attends its whole context (``plan.seq_lens``); padding rows (length 0) attend nothing.
    """
    k, v = cache_kv_nhd(keys, values)
    plan.attend(
        q=query, k=k, v=v, out=output, cu_seqlens_q=plan.cu_seqlens_q, max_seqlen_q=1, seqused_k=plan.seq_lens,
        max_seqlen_k=max(1, plan.max_seq_len), softmax_scale=scale, causal=True, block_table=block_table,
        scheduler_metadata=plan.scheduler, num_splits=plan.num_splits, fa_version=3,
    )  # fmt: skip
