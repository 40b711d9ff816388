"""CPU executor: vLLM's own CPU attention kernel driven over per-(request, KV head) page rows.

vLLM's ``cpu_attention_with_kv_cache`` takes a block table, per-row KV lengths and a causal flag
whose mask is bottom-right aligned (how vLLM runs chunked prefill). Viewing the head-major cache
as ``[num_blocks * head_slots, 1, N, D]`` turns each (block, KV head) into a one-head block, so a
row ``(request, KV head)`` becomes a "request" with ``num_kv_heads = 1`` and the ``G`` query heads of
its group, whose block table is the row's page ids. The tables put the chunk's pages last, so the
kernel's causal mask over the compacted pages is exact (see ``vllm_sparse.tables``).

The kernel runs with the ``vec`` ISA (AVX-512/AVX2), whose page packing is the ``planes`` order of
``vllm_sparse.layout`` (K channel-major, then V). It needs a head size that is a multiple of 32.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops

from vllm_sparse.policy import StepPlan
from vllm_sparse.tables import PageTables

ISA = "vec"


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
