"""FlashInfer executor: paged attention over (request, KV head) rows, reading the head-major cache in place.

Each (request, KV head) pair is one FlashInfer request with ``num_kv_heads=1`` and the
``G = Hq / Hkv`` query heads of its group. Pages are addressed by their physical id
``block * head_slots + head`` in the cache viewed as ``[num_blocks * head_slots, 1, N, D]``
(FlashInfer's HND order, token stride ``2D``: no copy). Rows list their past pages first and the
chunk's pages last (``vllm_sparse.tables``), so FlashInfer's bottom-right causal mask is exact.

Plan once per step, use in every layer: the schedule depends only on lengths (query tokens and
pages per row) that the ``StepPlan`` knows on the host. ``prepare`` runs FlashInfer's ``plan()``
(the metadata builder calls it; otherwise the first layer that meets the step does) and keeps
the result in the step's ``StepState.flashinfer``; a layer only copies its page ids into the
planned index buffer, in place, and runs: no device-to-host sync in forward. Steps whose requests all decode one token
need no query regrouping: ``query [B, Hq, D]`` viewed as ``[B * Hkv, G, D]`` is already the rows'
query, the output is written in place, and FlashInfer's decode wrapper splits long rows.

Limits: a row attends exactly ``RequestPlan.num_pages`` pages (fixed budgets: QuoKA, Quest);
variable ``Selection.counts`` (Twilight top-p) need ``executors.triton_paged``.
``flashinfer`` is imported lazily, on the first ``prepare``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_sparse.executors.rows import indptr, ragged_positions, row_lengths
from vllm_sparse.policy import StepPlan
from vllm_sparse.tables import PageTables

WORKSPACE_BYTES = 256 * 1024 * 1024


@dataclass
class PlannedStep:
    """What ``prepare`` planned for one step plan (one layer policy of one scheduler step), kept in
    ``StepState.flashinfer``.

    Attributes:
        wrapper: a planned ``BatchPrefillWithPagedKVCacheWrapper`` (``BatchDecode...`` for
            decode-only steps).
        indices: ``int32 [total_pages]`` the planned page-index buffer, rewritten per layer.
        flat: ``int64 [total_pages]`` positions of the valid entries in ``page_ids.view(-1)``
            for tables of ``width`` columns.
        width: ``max num_pages`` over the rows.
        decode_only: every request has one query token (rows are views of the query).
        tok, head: ``int64 [total_q]`` query token and KV head of each grouped query row
            (prefill steps only).
        made_for: ``(Hkv, G, D, q dtype, kv dtype, scale, device)`` it was planned for.
        last_ids: the ``page_ids`` tensor last copied into ``indices`` (dense steps share one).
    """

    made_for: tuple
    wrapper: object
    indices: torch.Tensor
    flat: torch.Tensor
    width: int
    decode_only: bool
    tok: torch.Tensor | None
    head: torch.Tensor | None
    last_ids: torch.Tensor | None = None


class FlashInferExecutor:
    """See ``executors.base.Executor``. One instance is shared by all layers of a process."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        self.workspace_bytes = workspace_bytes
        self._workspace: dict[torch.device, torch.Tensor] = {}
        self._wrappers: dict[tuple, object] = {}  # one per (layer policy, shapes), re-planned each step

    def _wrapper(self, key: tuple, device: torch.device, decode: bool, group: int):
        """The wrapper of one (layer policy, shapes, kind), created once and re-planned each step.

        Decode-only steps use FlashInfer's decode wrapper, which splits long KV rows over many
        thread blocks (the prefill kernel gives a one-token row one block); tensor cores for GQA
        groups its CUDA-core decode kernel does not specialise.
        """
        key = key + (decode,)
        w = self._wrappers.get(key)
        if w is None:
            import flashinfer

            ws = self._workspace.get(device)
            if ws is None:
                ws = self._workspace[device] = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
            if decode:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=group not in (1, 2, 4))
            else:
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND")
            self._wrappers[key] = w
        return w

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
    ) -> PlannedStep:
        """Plan one step (host work + small host-to-device copies), once per step plan and shapes.

        Args:
            plan: the step plan shared by the layers of one policy.
            num_kv_heads, group, head_size: ``Hkv``, ``G = Hq / Hkv`` and ``D``.
        """
        key = (num_kv_heads, group, head_size, q_dtype, kv_dtype, float(scale), torch.device(device))
        state = plan.state
        if state.flashinfer is None or state.flashinfer.made_for != key:
            state.flashinfer = self._plan(plan, key)
        return state.flashinfer

    def _plan(self, plan: StepPlan, key: tuple) -> PlannedStep:
        hkv, group, d, q_dtype, kv_dtype, scale, device = key
        q_len, pages, last, q_start = row_lengths(plan, hkv)
        width = int(pages.max()) if pages.numel() else 0
        rows = torch.arange(pages.numel())
        _, flat = ragged_positions(pages, rows * width, device)
        decode_only = bool((q_len == 1).all())
        tok = head = None
        if not decode_only:
            row, tok = ragged_positions(q_len, q_start, device)
            head = row % hkv
        wrapper = self._wrapper((plan.policy,) + key, device, decode_only, group)
        indices = torch.zeros(int(pages.sum()), dtype=torch.int32, device=device)
        if decode_only:
            wrapper.plan(
                indptr(pages),
                indices,
                last.to(torch.int32),
                num_qo_heads=group,
                num_kv_heads=1,
                head_dim=d,
                page_size=plan.page_size,
                sm_scale=scale,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
            )
        else:
            wrapper.plan(
                indptr(q_len),
                indptr(pages),
                indices,
                last.to(torch.int32),
                num_qo_heads=group,
                num_kv_heads=1,
                head_dim_qk=d,
                page_size=plan.page_size,
                causal=True,
                sm_scale=scale,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
            )
        return PlannedStep(key, wrapper, indices, flat, width, decode_only, tok, head)

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
        rows = tables.page_ids.shape[0]
        hkv = rows // len(plan.requests)
        t, hq, d = query.shape
        g = hq // hkv
        step = self.prepare(plan, hkv, g, d, query.dtype, page_keys.dtype, scale, query.device)
        if step.last_ids is not tables.page_ids:  # dense steps: one table for every layer
            ids = tables.page_ids
            assert ids.shape[1] == step.width and ids.is_contiguous()
            step.indices.copy_(ids.view(-1).index_select(0, step.flat))
            step.last_ids = ids
        kv = (page_keys.unsqueeze(1), page_values.unsqueeze(1))  # [num_pages, 1, N, D] HND
        if step.decode_only:  # row r * Hkv + h is query[r, h * G : (h + 1) * G]
            out = output.view(t * hkv, g, d) if output.dtype == query.dtype else None
            o = step.wrapper.run(query.reshape(t * hkv, g, d), kv, out=out)
            if out is None:
                output.copy_(o.view(t, hq, d))
            return
        q_rows = query.view(t, hkv, g, d)[step.tok, step.head]  # [rows' tokens, G, D]
        o_rows = step.wrapper.run(q_rows, kv)
        output.view(t, hkv, g, d)[step.tok, step.head] = o_rows.to(output.dtype)


_SHARED: FlashInferExecutor | None = None


def flashinfer_executor() -> FlashInferExecutor:
    """The process-wide executor (layers share its per-step plans)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = FlashInferExecutor()
    return _SHARED
