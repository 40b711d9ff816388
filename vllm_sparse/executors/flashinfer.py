"""FlashInfer executor: paged prefill over (request, KV head) rows, reading the head-major cache in place.

Each (request, KV head) pair is one FlashInfer request with ``num_kv_heads=1`` and the
``G = Hq / Hkv`` query heads of its group. Pages are addressed by their physical id
``block * head_slots + head`` in the cache viewed as ``[num_blocks * head_slots, 1, N, D]``
(FlashInfer's HND order, token stride ``2D``: no copy). Tables list each row's pages ascending
with the chunk's pages last (``tables``), so FlashInfer's bottom-right causal mask is exact.

Plan once per step: the schedule depends only on lengths (query tokens, pages and tokens per row),
which the ``StepPlan`` knows on the host. ``prepare`` runs ``plan()`` for a step plan; every
layer that shares that plan only copies its page ids into the planned index buffer (in place, same
address) and runs: no device-to-host sync per layer. Decode rows run through the same prefill
kernel with one query token.

Limits: rows must attend exactly ``RequestPlan.num_pages`` pages (fixed budgets: QuoKA, Quest);
variable ``Selection.counts`` (Twilight top-p) are not honoured yet. The plan is made by the first
layer that meets a step plan, not yet in the metadata builder (``prepare`` is the hook for it).

``flashinfer`` is imported lazily, on the first ``prepare``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_sparse.policy import StepPlan
from vllm_sparse.tables import PageTables

WORKSPACE_BYTES = 256 * 1024 * 1024
MAX_CACHED_PLANS = 4  # distinct layer policies (dense layers, overrides) in one step


@dataclass
class _Step:
    """Everything planned for one ``StepPlan``: FlashInfer wrapper and the per-layer gather indices.

    Attributes:
        plan: the step plan (held so that its ``id`` stays unique while cached).
        key: the shapes the plan was made for.
        wrapper: a planned ``BatchPrefillWithPagedKVCacheWrapper``.
        indices: ``int32 [total_pages]`` the planned page-index buffer, rewritten per layer.
        flat: ``int64 [total_pages]`` positions of the valid entries in ``page_ids.view(-1)``.
        tok, head: ``int64 [total_q]`` query token and KV head of each grouped query row.
    """

    plan: StepPlan
    key: tuple
    wrapper: object
    indices: torch.Tensor
    flat: torch.Tensor
    tok: torch.Tensor
    head: torch.Tensor


def _host_layout(plan: StepPlan, hkv: int, width: int):
    """Host arrays of the rows of a step: indptrs, last page lengths, gather and regroup indices."""
    n = plan.page_size
    qo, kv, last, flat, tok, head = [0], [0], [], [], [], []
    for r, req in enumerate(plan.requests):
        pages = req.num_pages
        last_len = req.seq_len - (req.total_pages - 1) * n
        toks = torch.arange(req.query_start, req.query_start + req.query_len)
        for h in range(hkv):
            row = r * hkv + h
            qo.append(qo[-1] + req.query_len)
            kv.append(kv[-1] + pages)
            last.append(last_len)
            flat.append(torch.arange(pages) + row * width)
            tok.append(toks)
            head.append(torch.full((req.query_len,), h))
    i32 = torch.int32
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)
    return (
        torch.tensor(qo, dtype=i32),
        torch.tensor(kv, dtype=i32),
        torch.tensor(last, dtype=i32),
        cat(flat),
        cat(tok),
        cat(head),
    )


class FlashInferExecutor:
    """See ``executors.base.Executor``. One instance is shared by all layers of a process."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        self.workspace_bytes = workspace_bytes
        self._workspace: dict[torch.device, torch.Tensor] = {}
        self._steps: list[_Step] = []

    def _new_wrapper(self, device: torch.device):
        import flashinfer

        ws = self._workspace.get(device)
        if ws is None:
            ws = self._workspace[device] = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND")

    def prepare(
        self,
        plan: StepPlan,
        num_kv_heads: int,
        group: int,
        head_size: int,
        width: int,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        scale: float,
        device: torch.device,
    ) -> _Step:
        """Plan one step (host work + small host-to-device copies); later calls with the same
        ``plan`` object and shapes return the cached step.

        Args:
            plan: the step plan shared by the layers of one policy.
            num_kv_heads, group, head_size: ``Hkv``, ``G = Hq / Hkv`` and ``D``.
            width: ``PageTables.page_ids.shape[1]`` (``max`` pages per row, host-known).
        """
        key = (num_kv_heads, group, head_size, width, q_dtype, kv_dtype, float(scale), device)
        for s in self._steps:
            if s.plan is plan and s.key == key:
                return s
        qo, kv, last, flat, tok, head = _host_layout(plan, num_kv_heads, width)
        if len(self._steps) >= MAX_CACHED_PLANS:
            wrapper = self._steps.pop(0).wrapper
        else:
            wrapper = self._new_wrapper(device)
        indices = torch.zeros(int(kv[-1]), dtype=torch.int32, device=device)
        wrapper.plan(
            qo,
            kv,
            indices,
            last,
            num_qo_heads=group,
            num_kv_heads=1,
            head_dim_qk=head_size,
            page_size=plan.page_size,
            causal=True,
            sm_scale=scale,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
        )
        step = _Step(plan, key, wrapper, indices, flat.to(device), tok.to(device), head.to(device))
        self._steps.append(step)
        return step

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
        rows, width = tables.page_ids.shape
        hkv = rows // len(plan.requests)
        t, hq, d = query.shape
        step = self.prepare(plan, hkv, hq // hkv, d, width, query.dtype, page_keys.dtype, scale, query.device)
        if step.tok.numel() == 0:
            return
        # per layer: the selected page ids into the planned buffer, in place (no sync)
        step.indices.copy_(tables.page_ids.reshape(-1).index_select(0, step.flat))
        q_rows = query.view(t, hkv, hq // hkv, d)[step.tok, step.head]  # [rows' tokens, G, D]
        kv = (page_keys.unsqueeze(1), page_values.unsqueeze(1))  # [num_pages, 1, N, D] HND
        o_rows = step.wrapper.run(q_rows, kv)
        output.view(t, hkv, hq // hkv, d)[step.tok, step.head] = o_rows.to(output.dtype)


_SHARED: FlashInferExecutor | None = None


def flashinfer_executor() -> FlashInferExecutor:
    """The process-wide executor (layers share its per-step plans)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = FlashInferExecutor()
    return _SHARED
