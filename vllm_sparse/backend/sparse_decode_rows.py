"""Sparse decode rows through vLLM's FlashAttention 3: after a layer's selection, each (request, KV head) row attends
its selected and forced pages with the kernel FLASH_ATTN runs for a decode batch, instead of the Triton decode kernel
(``kernels.decode_attention``), whose served speed lags its speed alone (README, session 40).

Each row is one FlashAttention sequence with one KV head and the ``G`` query heads of its group (as
``backend.flash_rows`` runs prefill rows): a one-launch kernel (``kernels.decode_row_tables``) writes the rows' page
ids into a persistent table, FlashAttention reads the head-major cache in place as ``[num_pages, N, 1, D]``.

CUDA graphs, as ``backend.dense_decode`` and vLLM's FlashAttention backend do them: for selectors whose rows select
exactly ``SELECT`` pages (``fixed_counts``: Quest, QuoKA, Kascade) every row's length is known on the host before the
step, and the builder plans each selecting policy once per step (``SparseDecodeRows.plan``: the rows' lengths on the
device and FA3's scheduler metadata for them, both in persistent buffers, a fixed split count for the batch sizes vLLM
captures); the captured layers read them at fixed addresses, so a graph replays for any lengths. Twilight's top-p
keeps a count known only on the device: its rows' lengths are what the row-table kernel writes, and FlashAttention
splits them on the device (no scheduler metadata, the fixed split count).
``kernels.decode_attention.decode_attention_reference`` is the twin.

``VLLM_SPARSE_SPARSE_DECODE=flash`` turns it on; the default, ``triton``, keeps the Triton decode kernel until a served
A/B shows which is faster.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_sparse.backend.dense_decode import kernel_switch
from vllm_sparse.backend.dense_prefill import flash_attn_version
from vllm_sparse.config import LayerPolicy
from vllm_sparse.decode_step import DecodeStep
from vllm_sparse.policy import HEAD, LAST, SELECT, TAIL, TOTAL

logger = logging.getLogger("vllm_sparse")

SPARSE_DECODE_ENV = "VLLM_SPARSE_SPARSE_DECODE"
KERNELS = ("triton", "flash")


def sparse_decode_kernel(environ=os.environ) -> str:
    """``VLLM_SPARSE_SPARSE_DECODE``: ``triton`` (default, also when empty) or ``flash``."""
    return kernel_switch(SPARSE_DECODE_ENV, KERNELS, environ)


def row_lengths(host_columns: np.ndarray, page_size: int) -> np.ndarray:
    """``int64 [B]`` tokens each row of a request attends when it selects exactly ``SELECT`` pages (the decode
    kernel's count: selected, then forced ``[0, HEAD) + [TAIL, TOTAL)``, the last page holding ``LAST``; 0 for
    padding). ``host_columns``: ``int32 [B, NUM_COLUMNS]``."""
    c = host_columns.astype(np.int64)
    pages = c[:, SELECT] + c[:, HEAD] + c[:, TOTAL] - c[:, TAIL]
    return np.where(c[:, TOTAL] > 0, (pages - 1) * page_size + c[:, LAST], 0)


@dataclass(frozen=True)
class SparseRowsPlan:
    """One step's FlashAttention call for the decode rows of one selecting policy (every layer of it).

    Attributes:
        attend: vLLM's ``flash_attn_varlen_func``.
        rows: ``B * Hkv`` rows (CUDA-graph padding included: length 0).
        lens: ``int32 [rows]`` tokens of each row (a view of a persistent buffer, device).
        cu_seqlens_q: ``int32 [rows + 1]`` ``0 .. rows`` (one query token a row; persistent).
        table: ``int32 [rows, W]`` the rows' page ids, written by each layer (a persistent buffer).
        scheduler: ``int32 [M]`` FA3's scheduler metadata for ``lens`` (a view of a persistent buffer), or None.
        max_len: the longest row (host).
        num_splits: splits per row (fixed for captured batch sizes; 0: FA3's own choice).
    """

    attend: Callable
    rows: int
    lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    table: torch.Tensor
    scheduler: torch.Tensor | None
    max_len: int
    num_splits: int


class SparseDecodeRows:
    """Plans, in the builder, the FlashAttention call of each selecting policy's decode rows (``run_sparse_rows``).

    ``create`` returns None where the switch is off or vLLM ships no FlashAttention 3 for these shapes.
    """

    def __init__(
        self, policies: list[LayerPolicy], num_heads_q: int, num_heads_kv: int, head_size: int, page_size: int,
        kv_dtype: torch.dtype, max_reqs: int, max_model_len: int, max_graph_batch: int, max_splits: int,
        device: torch.device, device_counts: bool = False, attend: Callable | None = None,
        schedule: Callable | None = None,
    ):  # fmt: skip
        """device_counts: the selector's counts are known only on the device (Twilight's top-p keeps up to
        ``SELECT``): the rows' lengths are the ones the row-table kernel writes, FlashAttention schedules its splits
        from them on the device (no scheduler metadata), and the host knows only their bound.
        attend, schedule: vLLM's ``flash_attn_varlen_func`` and ``get_scheduler_metadata`` (default; a CPU test
        passes torch twins)."""
        self.device_counts = device_counts
        if attend is None or schedule is None:
            from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

            attend, schedule = attend or flash_attn_varlen_func, schedule or get_scheduler_metadata
        self._attend, self._schedule = attend, schedule
        self.policies = list(dict.fromkeys(policies))
        self.group, self.num_kv_heads, self.head_size = num_heads_q // num_heads_kv, num_heads_kv, head_size
        self.page_size, self.kv_dtype = page_size, kv_dtype
        self.max_graph_rows, self.max_splits = max_graph_batch * num_heads_kv, max_splits
        rows = max(max_reqs, max_graph_batch) * num_heads_kv
        self._cu_q = torch.arange(rows + 1, dtype=torch.int32, device=device)
        # every row lists at most its request's pages: max_model_len // N + 1 columns bound any row
        self._table = torch.zeros(rows, max_model_len // page_size + 1, dtype=torch.int32, device=device)
        n = len(self.policies)
        self._lens = torch.zeros(n, rows, dtype=torch.int32, device=device)
        # host staging of ``_lens``: on CUDA two pinned buffers in turn, each rewritten only once the copy that last read
        # it has run (its event; with async scheduling the next step is planned while this one runs)
        pinned = torch.device(device).type == "cuda"
        self._staging = [torch.zeros(n, rows, dtype=torch.int32, pin_memory=pinned) for _ in range(2 if pinned else 1)]
        self._staged = [torch.cuda.Event() if pinned else None for _ in self._staging]
        self._turn = 0
        self._scheduler = torch.zeros(n, 1 + -(-rows // 4) * 4 * 4, dtype=torch.int32, device=device)
        self._index = {p: i for i, p in enumerate(self.policies)}

    @classmethod
    def create(
        cls, policies: list[LayerPolicy], num_heads_q: int, num_heads_kv: int, head_size: int, page_size: int,
        kv_dtype: torch.dtype, max_reqs: int, max_model_len: int, max_graph_batch: int, max_splits: int,
        device: torch.device, device_counts: bool = False,
    ) -> SparseDecodeRows | None:  # fmt: skip
        if not policies or sparse_decode_kernel() != "flash" or flash_attn_version(head_size, page_size) != 3:
            return None
        try:
            return cls(policies, num_heads_q, num_heads_kv, head_size, page_size, kv_dtype, max_reqs, max_model_len,
                       max_graph_batch, max_splits, device, device_counts)  # fmt: skip
        except ImportError as e:
            logger.info("vllm-sparse: sparse decode rows stay on the Triton kernel (%s)", e)
            return None

    def plan(self, decode: DecodeStep) -> dict[LayerPolicy, SparseRowsPlan]:
        """Host work of one step, outside any graph: per selecting policy, its rows' lengths (from the step's host
        columns, copied once to the device) and FA3's scheduler metadata for them; with ``device_counts``, only the
        bound of the lengths."""
        b, h = decode.num_reqs, self.num_kv_heads
        rows = b * h
        splits = self.max_splits if rows <= self.max_graph_rows else 0
        if self.device_counts:  # the layers' row-table kernel writes the lengths; FlashAttention schedules on its own
            plans = {}
            for p, i in self._index.items():
                bound = max(1, int(row_lengths(decode.host_columns[p], self.page_size).max(initial=0)))
                plans[p] = self._plan(rows, i, None, bound, splits)
            return plans
        t = self._turn = (self._turn + 1) % len(self._staging)
        if self._staged[t] is not None:
            self._staged[t].synchronize()  # the copy that last read this buffer (two steps ago) has run
        host = self._staging[t].numpy()
        plans = {}
        lens_by_policy = {}
        for p, i in self._index.items():
            lens = np.repeat(row_lengths(decode.host_columns[p], self.page_size), h)
            host[i, :rows] = lens
            host[i, rows:] = 0
            lens_by_policy[p] = int(lens.max(initial=0))
        self._lens.copy_(self._staging[t], non_blocking=self._staged[t] is not None)  # one copy for every policy
        if self._staged[t] is not None:
            self._staged[t].record()
        for p, i in self._index.items():
            lens = self._lens[i, :rows]
            max_len = max(1, lens_by_policy[p])
            meta = self._schedule(
                batch_size=rows, max_seqlen_q=1, max_seqlen_k=max_len, num_heads_q=self.group, num_heads_kv=1,
                headdim=self.head_size, cache_seqlens=lens, qkv_dtype=self.kv_dtype, cu_seqlens_q=self._cu_q[: rows + 1],
                page_size=self.page_size, causal=True, num_splits=splits,
            )  # fmt: skip
            n = meta.shape[0]
            scheduler = None
            if n <= self._scheduler.shape[1]:  # into the persistent buffer (zeros past it, as vLLM does)
                self._scheduler[i, :n] = meta
                self._scheduler[i, n:] = 0
                scheduler = self._scheduler[i, :n]
            plans[p] = self._plan(rows, i, scheduler, max_len, splits)
        return plans

    def _plan(self, rows: int, i: int, scheduler: torch.Tensor | None, max_len: int, splits: int) -> SparseRowsPlan:
        """The plan of policy ``i`` over the first ``rows`` rows of the persistent buffers."""
        lens, cu_q, table = self._lens[i, :rows], self._cu_q[: rows + 1], self._table[:rows]
        return SparseRowsPlan(self._attend, rows, lens, cu_q, table, scheduler, max_len, splits)


def run_sparse_rows(
    plan: SparseRowsPlan, query: torch.Tensor, page_keys: torch.Tensor, page_values: torch.Tensor,
    block_table: torch.Tensor, pages: torch.Tensor, counts: torch.Tensor, columns: torch.Tensor, head_slots: int,
    scale: float, output: torch.Tensor,
) -> None:  # fmt: skip
    """One layer's selected decode rows through vLLM's FlashAttention, as the step's plan says.

    Args:
        plan: the step's plan for this layer's policy (``SparseDecodeRows.plan``).
        query, output: ``[B, Hq, D]`` the decode block.
        page_keys, page_values: ``[num_pages, N, D]`` by physical page id (strided views).
        block_table: ``int32 [B, max_blocks]`` the decode requests' block-table rows.
        pages, counts, columns, head_slots: as ``decode_attention_triton`` takes them (the layer's selection).
    """
    from vllm_sparse.kernels.decode_row_tables import decode_row_tables_triton

    b, hq, d = query.shape
    g = hq // (plan.rows // b)
    decode_row_tables_triton(block_table, pages, counts, columns, head_slots, page_keys.shape[1], plan.table,
                             plan.lens)  # fmt: skip
    q = query.reshape(plan.rows, g, d)  # a copy only where the query's rows are strided
    out = output.view(plan.rows, g, d) if output.is_contiguous() else torch.empty_like(q)
    plan.attend(
        q=q, k=page_keys.unsqueeze(2), v=page_values.unsqueeze(2), out=out, cu_seqlens_q=plan.cu_seqlens_q,
        max_seqlen_q=1, seqused_k=plan.lens, max_seqlen_k=plan.max_len, softmax_scale=scale, causal=True,
        block_table=plan.table, scheduler_metadata=plan.scheduler, num_splits=plan.num_splits, fa_version=3,
    )  # fmt: skip
    if out.data_ptr() != output.data_ptr():
        output.copy_(out.view(b, hq, d))
