"""Stage 1, policy: per request, dense or sparse, how many pages to select, which pages are forced.

Everything here is computed on the host from lengths the scheduler already knows, once per
(step, layer policy), so that page counts are known before any kernel runs.

Logical pages of a request are numbered from its first token: page ``p`` holds positions
``[p * N, (p + 1) * N)``. With ``ctx`` tokens before the current chunk (or decode token) and
``seq = ctx + query_len``:

* *past pages* are the complete pages before the chunk: ``[0, ctx // N)``;
* *chunk pages* hold the chunk's tokens: ``[ctx // N, ceil(seq / N))``; the first may also hold
  past tokens when the chunk starts inside a page, the last may be partial;
* *forced pages* are sink pages, local-window pages and chunk pages; the selector picks among
  the other past pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_sparse.config import LayerPolicy
from vllm_sparse.step_state import StepState


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class RequestPlan:
    query_start: int
    query_len: int
    context_len: int
    seq_len: int
    sparse: bool
    num_select: int  # pages the selector may pick per KV head (the cap; 0 for dense requests)
    num_past_pages: int  # complete pages before the chunk: the selector's candidates
    forced: torch.Tensor  # int64 [F]: ascending logical pages always attended (all pages if dense)
    page_size: int = 16
    # ``forced`` is always two ranges, ``[0, forced_head) + [forced_tail, total_pages)``: sink pages,
    # then the local window and the chunk (dense requests: ``[0, total_pages)``). Tables are built
    # from these two numbers on the device, without materialising ``forced`` per row.
    forced_head: int = 0
    forced_tail: int = 0

    @property
    def num_pages(self) -> int:
        """Pages attended per KV head at most (rows with a smaller selection count attend fewer)."""
        return self.forced.numel() + self.num_select

    @property
    def total_pages(self) -> int:
        """Pages a dense backend would attend per KV head."""
        return -(-self.seq_len // self.page_size)

    @property
    def forced_past(self) -> torch.Tensor:
        """The forced pages among the past pages (sink, local window), host ``int64 [F']``; on the
        device, once per step: ``StepState.forced_past``."""
        return self.forced[self.forced < self.num_past_pages]


@dataclass(frozen=True)
class StepPlan:
    """The plan of one layer policy for one scheduler step: one entry per request, in batch order.

    ``state`` (``step_state.StepState``) holds what the layers of the step derive from the plan and
    share: device copies, the forced part of the page tables, the decode batch, executor plans.
    """

    page_size: int
    requests: tuple[RequestPlan, ...]
    policy: LayerPolicy | None = None  # the layer policy it was planned for
    state: StepState = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", StepState(self))  # frozen: set once, here

    @property
    def max_select(self) -> int:
        return max((r.num_select for r in self.requests), default=0)

    @property
    def any_sparse(self) -> bool:
        return any(r.sparse for r in self.requests)


#: ``sparse_pays(query_len, context_len, kept_tokens)``: whether a prefill chunk that attends
#: ``kept_tokens`` past tokens (selected + sink + local) instead of all ``context_len`` runs faster
#: sparse, selection included (``vllm_sparse.cost``).
SparsePays = Callable[[int, int, int], bool]


def plan_request(
    policy: LayerPolicy,
    page_size: int,
    query_start: int,
    query_len: int,
    seq_len: int,
    sparse_pays: SparsePays | None = None,
    force_dense: bool = False,
) -> RequestPlan:
    """Plan one request. A prefill chunk (``query_len > 1``) of a policy with
    ``sparse_prefill=None`` runs sparse only where ``sparse_pays`` says so (when given);
    ``force_dense``: dense whatever the policy (a dense tail, ``split_dense_tails``)."""
    n = page_size
    ctx = seq_len - query_len
    total_pages = cdiv(seq_len, n)
    num_past = ctx // n
    budget_tokens = policy.budget.tokens(ctx)

    sink = set(range(min(cdiv(policy.sink_tokens, n), num_past)))
    local = set(range(max(0, (ctx - policy.local_tokens) // n), num_past)) if policy.local_tokens else set()
    forced_past = sink | local
    selectable = num_past - len(forced_past)
    budget_pages = cdiv(budget_tokens, n)
    num_select = min(selectable, max(0, budget_pages - len(forced_past)))

    if policy.select_all:  # the selector's rule decides how many (compact): every candidate, no budget
        num_select = selectable
    covered = selectable == 0 if policy.select_all else (budget_tokens >= ctx or num_select >= selectable)
    dense = (
        force_dense
        or policy.dense
        or (query_len == 1 and not policy.sparse_decode)
        or ctx == 0
        or ctx < policy.dense_below_tokens
        or (not policy.force_sparse and covered)
        or (query_len > 1 and policy.sparse_prefill is False)
    )
    def dense_plan() -> RequestPlan:  # built only for requests that run dense
        every_page = torch.arange(total_pages, dtype=torch.int64)
        return RequestPlan(query_start, query_len, ctx, seq_len, False, 0, num_past, every_page, n, total_pages, total_pages)

    if dense:
        return dense_plan()
    if policy.select_fraction is not None and (query_len == 1 or policy.select_fraction_prefill):
        # a method-specific count, e.g. twilight's candidates: select_fraction of the context (at most
        # the budget's max_tokens), pruned later (top-p)
        cand_tokens = int(policy.select_fraction * ctx)
        if policy.budget.max_tokens is not None:
            cand_tokens = min(cand_tokens, policy.budget.max_tokens)
        num_select = min(selectable, max(0, cdiv(cand_tokens, n) - len(forced_past)))
    by_cost = query_len > 1 and policy.sparse_prefill is None and not policy.force_sparse and sparse_pays is not None
    if by_cost and not policy.select_all:  # (the cost model cannot know what a select_all selector keeps)
        if not sparse_pays(query_len, ctx, (num_select + len(forced_past)) * n):  # dense costs less
            return dense_plan()
    head = len(sink)
    tail = max(min(local, default=num_past), head)
    forced = torch.cat([torch.arange(head), torch.arange(tail, total_pages)])
    return RequestPlan(query_start, query_len, ctx, seq_len, True, num_select, num_past, forced, n, head, tail)


def plan_step(
    policy: LayerPolicy,
    page_size: int,
    query_start_loc: list[int],
    seq_lens: list[int],
    sparse_pays: SparsePays | None = None,
    dense: Sequence[bool] = (),
) -> StepPlan:
    """Plan every request of a step.

    Args:
        query_start_loc: ``[B + 1]`` token offsets of each request's queries (host).
        seq_lens: ``[B]`` context + query tokens of each request (host).
        sparse_pays: the prefill cost decision (``plan_request``); None: thresholds only.
        dense: per request, True where it runs dense whatever the policy (``split_dense_tails``);
            empty: none.
    """
    reqs = tuple(
        plan_request(
            policy, page_size, query_start_loc[i], query_start_loc[i + 1] - query_start_loc[i], s, sparse_pays,
            force_dense=bool(dense) and dense[i],
        )
        for i, s in enumerate(seq_lens)
    )  # fmt: skip
    return StepPlan(page_size, reqs, policy)


@dataclass(frozen=True)
class DenseTails:
    """A step's prefill requests with each chunk's last queries split off as a request of their own.

    Attributes:
        query_start_loc: ``[B' + 1]`` query offsets of the requests after the split.
        seq_lens: ``[B']`` their context + query tokens.
        rows: ``[B']`` the original request (block-table row) of each.
        dense: ``[B']`` True for the dense tails.
    """

    query_start_loc: list[int]
    seq_lens: list[int]
    rows: list[int]
    dense: tuple[bool, ...]


def split_dense_tails(query_start_loc: Sequence[int], seq_lens: Sequence[int], tail: int,
                      min_context: int = 0) -> DenseTails | None:  # fmt: skip
    """Give the last ``tail`` queries of each prefill chunk (query length > 1) a dense request of their own.

    A chunk with more than ``tail`` queries becomes two requests on the same block-table row: its first
    queries (whose context ends where the tail starts) and its last ``tail`` queries, marked dense; a
    chunk of at most ``tail`` queries is marked dense whole. Chunks with fewer than ``min_context`` past
    tokens (they run dense anyway) and decodes are left alone. Returns None when nothing changes.
    """
    qsl, seqs, rows, dense = [query_start_loc[0]], [], [], []
    for i, seq in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q = end - start
        has_tail = tail > 0 and q > 1 and seq - q >= max(min_context, 1)
        if has_tail and q > tail:  # the chunk's head: its context ends where the tail starts
            qsl.append(end - tail)
            seqs.append(seq - tail)
            rows.append(i)
            dense.append(False)
        qsl.append(end)
        seqs.append(seq)
        rows.append(i)
        dense.append(has_tail)
    if not any(dense):
        return None
    return DenseTails(qsl, seqs, rows, tuple(dense))


# ---------------------------------------------------------------------------------------------
# Decode requests, vectorised: the columns the device-driven decode path reads
# ---------------------------------------------------------------------------------------------

#: Columns of ``decode_columns`` (int32), one row per decode request.
SELECT, HEAD, TAIL, TOTAL, LAST, PAST = range(6)
NUM_COLUMNS = 6


def decode_columns(policy: LayerPolicy, page_size: int, seq_lens: np.ndarray) -> np.ndarray:
    """``plan_request`` for requests with one query token, vectorised over the batch.

    Args:
        seq_lens: ``int [B]`` context + 1 of each decode request; 0 marks a padding row (CUDA-graph
            batches are padded to a captured size), which attends nothing.
    Returns:
        ``int32 [B, NUM_COLUMNS]``: per request ``SELECT`` pages to select (0: nothing to select),
        the forced pages ``[0, HEAD) + [TAIL, TOTAL)`` (dense rows: ``HEAD = TAIL = 0``, i.e. every
        page), ``TOTAL`` pages, ``LAST`` tokens in the last page and ``PAST`` complete past pages.
        A row attends ``SELECT``-or-fewer selected pages (top-p selectors keep fewer) plus its
        forced pages. Equal to ``plan_request(policy, page_size, i, 1, seq_len)`` row by row.
    """
    n = page_size
    seq = np.asarray(seq_lens, dtype=np.int64)
    ctx = np.maximum(seq - 1, 0)
    total = -(-seq // n)
    past = ctx // n
    want = np.maximum(np.floor(policy.budget.fraction * ctx).astype(np.int64), policy.budget.min_tokens)
    budget = want if policy.budget.max_tokens is None else np.minimum(want, policy.budget.max_tokens)
    head = np.minimum(-(-policy.sink_tokens // n), past)
    local_start = np.maximum(0, (ctx - policy.local_tokens) // n) if policy.local_tokens else past
    tail = np.maximum(local_start, head)
    selectable = past - head - (past - tail)
    num_select = np.minimum(selectable, np.maximum(0, -(-budget // n) - head - (past - tail)))
    dense = (
        np.full(seq.shape, policy.decodes_dense)
        | (ctx == 0)
        | (ctx < policy.dense_below_tokens)
        | (seq <= 0)
    )
    if not policy.force_sparse:
        dense |= (budget >= ctx) | (num_select >= selectable)
    if policy.select_fraction is not None:
        cand = np.floor(policy.select_fraction * ctx).astype(np.int64)
        if policy.budget.max_tokens is not None:
            cand = np.minimum(cand, policy.budget.max_tokens)
        num_select = np.minimum(selectable, np.maximum(0, -(-cand // n) - head - (past - tail)))
    out = np.zeros((seq.shape[0], NUM_COLUMNS), dtype=np.int32)
    sparse = ~dense
    out[:, SELECT] = np.where(sparse, num_select, 0)
    out[:, HEAD] = np.where(sparse, head, 0)
    out[:, TAIL] = np.where(sparse, tail, 0)
    out[:, TOTAL] = np.maximum(total, 0)
    out[:, LAST] = np.where(seq > 0, seq - (total - 1) * n, 0)
    out[:, PAST] = past
    return out


def select_cap(policy: LayerPolicy, page_size: int, max_model_len: int) -> int:
    """The most pages ``decode_columns`` can ask a row to select for requests up to
    ``max_model_len`` tokens: the width of a decode step's selection buffers."""
    n = page_size
    past_cap = max_model_len // n
    b = policy.budget
    if policy.force_sparse or policy.select_all:
        return past_cap
    tokens = max_model_len if b.max_tokens is None else max(b.max_tokens, b.min_tokens)
    if policy.select_fraction is not None:
        tokens = int(policy.select_fraction * max_model_len)
        if b.max_tokens is not None:
            tokens = min(tokens, b.max_tokens)
    return max(0, min(past_cap, -(-tokens // n)))
