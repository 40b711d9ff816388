"""CPU executor: vLLM's own CPU attention kernel driven over per-(request, KV head) page rows.

vLLM's ``cpu_attention_with_kv_cache`` takes a block table, per-row KV lengths and a causal flag
whose mask is bottom-right aligned (how vLLM runs chunked prefill). Viewing the head-major cache
as ``[num_blocks * head_slots, 1, N, D]`` turns each (block, KV head) into a one-head block, so a
row ``(request, KV head)`` becomes a "request" with ``num_kv_heads = 1`` and the ``G`` query heads of
its group, whose block table is the row's page ids. The tables put the chunk's pages last, so the
kernel's causal mask over the compacted pages is exact (see ``vllm_sparse.tables``).

The kernel runs with the ``vec`` ISA (AVX-512/AVX2), whose page packing is the ``planes`` order of
``vllm_sparse.layout`` (K channel-major, then V). It needs a head size that is a multiple of 32.

A step whose requests all run dense (``CpuAttnExecutor.dense``) makes CPU_ATTN's own call instead: the
step's requests over the real block table, every KV head at once, on the cache's strided
``[num_blocks, Hkv, N, D]`` views (the kernel reads a block's and a head's stride from the tensors, so
the metadata slots between blocks are skipped), with CPU_ATTN's KV split. Its scheduler metadata is
made once per step plan (``StepState.cpu_dense``) and read by every layer of the plan.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from vllm import _custom_ops as ops

from vllm_sparse.policy import StepPlan
from vllm_sparse.tables import PageTables

ISA = "vec"


def _kv_split() -> bool:
    """CPU_ATTN's choice of splitting a long KV range over threads (``VLLM_CPU_ATTN_SPLIT_KV``, default on)."""
    try:
        from vllm import envs

        return bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
    except AttributeError:  # a vLLM without the switch
        return True


class DenseStep(NamedTuple):
    """A dense step's call geometry, made once per step plan (``StepState.cpu_dense``).

    Attributes:
        made_for: ``(Hq, Hkv, D, dtype)`` the shapes the scheduler metadata was made for.
        query_start_loc: ``int32 [B + 1]`` the requests' query offsets.
        seq_lens: ``int32 [B]`` their context + query tokens.
        scheduler: the kernel's scheduler metadata (its split of the work over threads).
    """

    made_for: tuple
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scheduler: torch.Tensor


def dense_step(plan: StepPlan, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> DenseStep:
    """The step plan's ``DenseStep`` (its requests as CPU_ATTN schedules them), kept in ``plan.state``."""
    made_for = (num_heads, num_kv_heads, head_dim, dtype)
    state = plan.state
    if state.cpu_dense is None or state.cpu_dense.made_for != made_for:
        reqs = plan.requests
        qsl = torch.tensor([reqs[0].query_start] + [r.query_start + r.query_len for r in reqs], dtype=torch.int32)
        seq = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(reqs), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seq_lens=seq,
            dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=ISA,
            enable_kv_split=_kv_split(),
        )  # fmt: skip
        state.cpu_dense = DenseStep(made_for, qsl, seq, sched)
    return state.cpu_dense


class CpuAttnExecutor:
    """Implements ``vllm_sparse.executors.base.Executor`` with vLLM's CPU attention ops."""

    def __init__(self) -> None:
        # the rows' gather indices depend on the plan; the kernel's scheduler metadata (its split of
        # the work) also on the rows' lengths, which differ per layer where a top-p keeps a
        # different number of pages (Twilight): both are reused while neither changes
        self._plan: StepPlan | None = None
        self._rows: tuple | None = None
        self._kv_lens: torch.Tensor | None = None
        self._sched = None

    @staticmethod
    def dense(
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        block_table: torch.Tensor,
        plan: StepPlan,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """A step whose requests all run dense, as CPU_ATTN runs it (no page rows, no tables).

        Args:
            query, output: ``[T, Hq, D]`` the step's tokens, request-major as ``plan.requests``.
            keys, values: ``[num_blocks, Hkv, N, D]`` strided views of the cache (``PageLayout.keys``).
            block_table: ``int [B, max_blocks]`` the requests' physical blocks.
            plan: the step's plan (every request dense); its state keeps the scheduler metadata.
        """
        t, hq, d = query.shape
        step = dense_step(plan, hq, keys.shape[1], d, query.dtype)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=keys, value_cache=values, output=output, query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32),
            softcap=0.0, scheduler_metadata=step.scheduler, s_aux=None, dynamic_causal=None, k_scale=1.0,
            v_scale=1.0, kv_cache_dtype="auto",
        )  # fmt: skip

    def _row_layout(self, plan: StepPlan, tables: PageTables, hkv: int, device) -> tuple:
        """Token/head gather indices and query offsets of the rows, once per plan.

        Returns ``(tok [R_T], head [R_T], qsl int32 [rows + 1])`` where ``R_T = T * Hkv`` and row
        ``r * Hkv + h`` holds request ``r``'s queries for KV head ``h``.
        """
        toks, heads, lens = [], [], []
        for req in plan.requests:
            t = torch.arange(req.query_start, req.query_start + req.query_len)
            for h in range(hkv):
                toks.append(t)
                heads.append(torch.full_like(t, h))
                lens.append(req.query_len)
        qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        return torch.cat(toks).to(device), torch.cat(heads).to(device), qsl.to(device)

    def __call__(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        page_values: torch.Tensor,
        tables: PageTables,
        plan: StepPlan,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """query/output ``[T, Hq, D]``; page_keys/values ``[P, N, D]`` (strided views of the cache)."""
        num_rows = tables.page_ids.shape[0]
        hkv = num_rows // len(plan.requests)
        t, hq, d = query.shape
        g = hq // hkv
        if plan is not self._plan:
            self._plan, self._rows, self._kv_lens = plan, self._row_layout(plan, tables, hkv, query.device), None
        tok, head, qsl = self._rows
        if self._kv_lens is None or not torch.equal(tables.kv_lens, self._kv_lens):
            self._sched = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=num_rows, num_heads=g, num_kv_heads=1, head_dim=d, seq_lens=tables.kv_lens,
                dtype=query.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=ISA,
                enable_kv_split=False,
            )  # fmt: skip
            self._kv_lens = tables.kv_lens.clone()
        sched = self._sched
        rows_q = query.view(t, hkv, g, d)[tok, head]  # [T * Hkv, G, D], row-major
        rows_out = torch.empty_like(rows_q)
        ops.cpu_attention_with_kv_cache(
            query=rows_q,
            key_cache=page_keys.unsqueeze(1),
            value_cache=page_values.unsqueeze(1),
            output=rows_out,
            query_start_loc=qsl,
            seq_lens=tables.kv_lens,
            scale=scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=tables.page_ids.to(torch.int32),
            softcap=0.0,
            scheduler_metadata=sched,
            s_aux=None,
            dynamic_causal=None,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        output.view(t, hkv, g, d)[tok, head] = rows_out.to(output.dtype)
