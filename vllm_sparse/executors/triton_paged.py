"""Triton paged attention executor: honours variable per-row page counts read on the device.

Rows whose page counts are only known on the device (Twilight's top-p rows) run without padding
and without a host sync: the kernel (``kernels.paged_attention``) stops at ``tables.kv_lens[row]``.
Everything host-side (work items per (row, query block), split-KV geometry) comes from the
``StepPlan`` and is built once per step, kept in the step's ``StepState.triton_paged`` and shared
by every layer of the step.
Twin / test oracle: ``executors.reference.reference_executor``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_sparse.kernels.paged_attention import WorkPlan, num_sms, paged_attention_triton
from vllm_sparse.policy import StepPlan
from vllm_sparse.tables import PageTables


class PagedStep(NamedTuple):
    """The executor's plan of one step (``StepState.triton_paged``)."""

    made_for: tuple  # (Hkv, G, block_n, SMs, device) it was planned for
    work: WorkPlan  # work items per (row, query block), split-KV geometry


class TritonPagedExecutor:
    """See ``executors.base.Executor``; ``block_n``: tokens per K/V tile (a power of two >= 16)."""

    def __init__(self, block_n: int = 64, num_sms: int | None = None):
        self.block_n = block_n
        self.num_sms = num_sms

    def work_plan(self, plan: StepPlan, num_kv_heads: int, group: int, device: torch.device) -> WorkPlan:
        """The step's launch geometry, made once per step (not per layer): ``plan.state.triton_paged``."""
        sms = self.num_sms or num_sms(device)
        made_for = (num_kv_heads, group, self.block_n, sms, str(device))
        state = plan.state
        if state.triton_paged is None or state.triton_paged.made_for != made_for:
            g_pad = 1 << (group - 1).bit_length()
            max_q = max(r.query_len for r in plan.requests)
            block_m = 16 if max_q * g_pad <= 16 else 64
            max_tokens = max(r.num_pages for r in plan.requests) * plan.page_size
            starts = [r.query_start for r in plan.requests]
            lens = [r.query_len for r in plan.requests]
            work = WorkPlan(starts, lens, max_tokens, num_kv_heads, group, device, block_m, self.block_n, sms)
            state.triton_paged = PagedStep(made_for, work)
        return state.triton_paged.work

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
        """query/output ``[T, Hq, D]``, pages ``[num_pages, N, D]`` (strided views, read in place)."""
        if not plan.requests:
            return
        hkv = tables.page_ids.shape[0] // len(plan.requests)
        group = query.shape[1] // hkv
        work = self.work_plan(plan, hkv, group, query.device)
        page_ids = tables.page_ids if tables.page_ids.stride(-1) == 1 else tables.page_ids.contiguous()
        paged_attention_triton(
            query, page_keys, page_values, page_ids, tables.kv_lens, work, hkv, scale, output, self.block_n
        )


def triton_paged_executor(**kwargs) -> TritonPagedExecutor:
    return TritonPagedExecutor(**kwargs)
