"""Sparse prefill rows through vLLM's FlashAttention (FA3 on Hopper): the executor of the
host-planned path on GPUs where vLLM ships FlashAttention.

Each (request, KV head) row of the page tables is one FlashAttention sequence with one KV head and
the ``G = Hq / Hkv`` query heads of its group. The cache viewed as ``[num_pages, N, 1, D]`` (page
id ``block * head_slots + head``, token stride ``2D``) is a paged KV layout FlashAttention reads in
place; a row's page-table row is its block table and ``kv_lens`` its ``seqused_k``, both on the
device, so rows with counts known only on the device (Twilight's top-p) need no sync and no
padding. Rows list the chunk's pages last (``vllm_sparse.tables``), so FlashAttention's
bottom-right causal mask is exact. Per attended key this is the kernel FLASH_ATTN runs for dense
attention: the chunk's own causal part costs what it costs dense, and the selected past pages
what their tokens cost.

Plan once per step, use in every layer (``prepare``: query offsets of the rows and the gather
positions of their query tokens, from the ``StepPlan`` on the host, kept in the step's
``StepState.flash_rows``); a layer gathers its queries
into row order, runs one FlashAttention call and scatters the rows back into ``output``.
``executors.reference.reference_executor`` is the twin and test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_sparse.backend.dense_prefill import flash_attn_version
from vllm_sparse.executors.rows import indptr, ragged_positions, row_lengths
from vllm_sparse.policy import StepPlan
from vllm_sparse.tables import PageTables

_SHARED: dict[tuple[int, int], FlashRowsExecutor | None] = {}


@dataclass(frozen=True)
class RowsStep:
    """What ``prepare`` planned for one step plan (``StepState.flash_rows``: shared by every layer of
    its policy).

    Attributes:
        cu_seqlens_q: ``int32 [rows + 1]`` query offsets of the rows (request-major, ``row =
            request * Hkv + head``), in the gathered row order.
        tok, head: ``int64 [total_q]`` query token and KV head of each gathered query row.
        max_seqlen_q: the longest chunk; max_seqlen_k: tokens of the widest row (an upper bound
            for rows whose counts vary on the device).
        made_for: ``(Hkv, device)`` it was planned for.
    """

    cu_seqlens_q: torch.Tensor
    tok: torch.Tensor
    head: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    made_for: tuple[int, str]


def rows_step(plan: StepPlan, num_kv_heads: int, device: torch.device) -> RowsStep:
    """Host work of one step: ``O(requests)`` numbers and three small host-to-device copies."""
    q_lens, _, _, q_starts = row_lengths(plan, num_kv_heads)
    row, tok = ragged_positions(q_lens, q_starts, device)
    return RowsStep(
        cu_seqlens_q=indptr(q_lens).to(device, non_blocking=True),
        tok=tok,
        head=row % num_kv_heads,
        max_seqlen_q=max(r.query_len for r in plan.requests),
        max_seqlen_k=max(r.num_pages for r in plan.requests) * plan.page_size,
        made_for=(num_kv_heads, str(device)),
    )


class FlashRowsExecutor:
    """See ``executors.base.Executor``; ``create`` gives None where vLLM has no FlashAttention
    with paged KV for this GPU (the FlashInfer or Triton executors run then)."""

    def __init__(self, fa_version: int, attention=None):
        """attention: the varlen paged attention function (default vLLM's
        ``flash_attn_varlen_func``; ``flash_varlen_reference`` is its torch twin)."""
        if attention is None:
            from vllm.vllm_flash_attn import flash_attn_varlen_func as attention
        self._fn = attention
        self.fa_version = fa_version

    @classmethod
    def create(cls, head_size: int, page_size: int) -> FlashRowsExecutor | None:
        """The process-wide executor for these shapes (layers share one, so the builder plans each
        step once), or None."""
        key = (head_size, page_size)
        if key not in _SHARED:
            _SHARED[key] = cls._create(head_size, page_size)
        return _SHARED[key]

    @classmethod
    def _create(cls, head_size: int, page_size: int) -> FlashRowsExecutor | None:
        version = flash_attn_version(head_size, page_size)
        return None if version is None else cls(version)

    def prepare(
        self,
        plan: StepPlan,
        num_kv_heads: int,
        group: int,
        head_size: int,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        scale: float,
        device: torch.device,
    ) -> RowsStep:
        """The step's row geometry, made once per step plan (the metadata builder calls this) and kept
        in ``plan.state.flash_rows``."""
        state = plan.state
        if state.flash_rows is None or state.flash_rows.made_for != (num_kv_heads, str(device)):
            state.flash_rows = rows_step(plan, num_kv_heads, device)
        return state.flash_rows

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
        """query/output ``[T, Hq, D]``; page_keys/values ``[num_pages, N, D]`` (strided views)."""
        if not plan.requests:
            return
        t, hq, d = query.shape
        hkv = tables.page_ids.shape[0] // len(plan.requests)
        g = hq // hkv
        step = self.prepare(plan, hkv, g, d, query.dtype, page_keys.dtype, scale, query.device)
        q_rows = query.view(t, hkv, g, d)[step.tok, step.head]  # [total_q, G, D]
        out_rows = torch.empty_like(q_rows)
        self._fn(
            q=q_rows,
            k=page_keys.unsqueeze(2),  # [num_pages, N, 1, D]
            v=page_values.unsqueeze(2),
            out=out_rows,
            cu_seqlens_q=step.cu_seqlens_q,
            max_seqlen_q=step.max_seqlen_q,
            seqused_k=tables.kv_lens,
            max_seqlen_k=step.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=tables.page_ids.to(torch.int32),
            fa_version=self.fa_version,
        )
        output.view(t, hkv, g, d)[step.tok, step.head] = out_rows.to(output.dtype)


def flash_varlen_reference(
    q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal, block_table, fa_version
) -> torch.Tensor:
    """Torch twin of the FlashAttention call above (paged KV, varlen queries, bottom-right causal
    mask): q/out ``[total_q, Hq, D]``, k/v ``[num_pages, N, Hkv, D]``, block_table ``int32 [S,
    max_pages]``, seqused_k ``int32 [S]``; writes and returns ``out``."""
    cu, lens, table = cu_seqlens_q.tolist(), seqused_k.tolist(), block_table.long()
    n, hkv = k.shape[1], k.shape[2]
    for s in range(len(lens)):
        qs = q[cu[s] : cu[s + 1]].float()  # [C, Hq, D]
        c, hq = qs.shape[0], qs.shape[1]
        pos = torch.arange(lens[s], device=q.device)
        pages = table[s, pos // n]
        ks = k[pages, pos % n].float().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        vs = v[pages, pos % n].float().repeat_interleave(hq // hkv, dim=1)
        logits = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
        if causal:
            limit = torch.arange(c, device=q.device) + lens[s] - c
            logits = logits.masked_fill(pos[None, None, :] > limit[None, :, None], float("-inf"))
        out[cu[s] : cu[s + 1]] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), vs).to(out.dtype)
    return out
