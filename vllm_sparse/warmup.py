"""Compile every kernel of the host-planned sparse path at engine start, not in the first request.

vLLM's start-up warm-up runs prompts of two tokens: they take the dense shortcut, so without this
the first long request would JIT-compile the selection, table and attention kernels of the sparse
prefill path (seconds, and a warning of vLLM's JIT monitor). The device decode path needs nothing
here: its kernels compile during vLLM's decode warm-up steps and CUDA-graph capture.

``warm_up_prefill`` runs the selector, the page tables and the executor of one layer on synthetic
sparse chunks over existing pages of its cache (read only; nothing is written to the cache), in
the shapes whose kernel variants real chunks reach, so that every tile and split choice the
launchers make is compiled, twice: under the layer's own budget, sink and local window, and under
half the context with neither (``scoring_policy``), because the layer's forced pages can leave a
short past nothing to score (sink 32 and local 64 fill a 25% budget of 233 tokens), while a real
request's longer context then scores a page count of that tile:

- chunks of 3, 33 and 300 queries: the query tiles (up to 16 scoring rows, up to 64, more);
- a short past (a dozen pages), a long one (about 5,000 tokens) and one of 1,100 pages, each
  within the engine's ``max_model_len``: the page tiles (up to 32 past pages, more, more than
  1,024) and the executor's token split (none for short rows, split for long rows of few items).

The synthetic block tables have the engine's row stride and every context fits in it: Triton
specialises a kernel on whether an integer argument divides by 16, and a block table wider than
the engine's (a context past ``max_model_len``) would compile variants no real step takes. Kernel
arguments that vary with the data are marked ``do_not_specialize``, so these shapes stand for all
others.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors.base import empty_selection
from vllm_sparse.tables import build_page_tables

#: query tokens of the synthetic chunks
WARMUP_CHUNKS = (300, 33, 3)
#: past tokens before them: a short past and a long one (clamped to the engine's context)...
WARMUP_PASTS = (200, 5000)
#: ...and one of more than 1024 past pages, where Quest's prefill bounds take wider page tiles
LONG_PAST_PAGES = 1100
#: blocks of the scratch cache a layer warms up on before its real cache exists (the chunks'
#: block tables wrap around it)
SCRATCH_BLOCKS = 64


def warmup_steps(max_tokens: int | None, page_size: int = 16) -> list[tuple[int, int]]:
    """``(chunk tokens, sequence tokens)`` of the synthetic steps, each sequence within ``max_tokens``
    (None: no limit); a step that would not fit is shortened or dropped, never widened."""
    steps = []
    for past in (*WARMUP_PASTS, LONG_PAST_PAGES * page_size):
        for chunk in WARMUP_CHUNKS:
            seq = chunk + past if max_tokens is None else min(chunk + past, max_tokens)
            if seq - chunk >= 1 and (chunk, seq) not in steps:
                steps.append((chunk, seq))
    return steps


def scoring_policy(policy: LayerPolicy, page_size: int) -> LayerPolicy:
    """``policy`` selecting half of every warm-up chunk's past pages, none of them forced: every step
    scores pages, whatever the layer's own budget, sink and local window leave to select."""
    half = Budget(fraction=0.5, min_tokens=page_size, max_tokens=None)
    return dataclasses.replace(policy, budget=half, sink_tokens=0, local_tokens=0)


def warm_up_prefill(
    selector,
    execute,
    policy: LayerPolicy,
    layout: PageLayout,
    page_keys: torch.Tensor,
    page_values: torch.Tensor,
    meta: PageMeta | None,
    num_heads: int,
    scale: float,
    dtype: torch.dtype,
    block_table_width: int | None = None,
) -> None:
    """Run one layer's sparse prefill path on synthetic chunks (outputs discarded).

    Args:
        selector, execute: the layer's selector and executor.
        policy: the layer's policy; the chunks run sparse whatever its thresholds (a dense layer's
            policy is warmed as if it were sparse: the kernels are shared).
        page_keys, page_values: ``[num_pages, N, D]`` views of the layer's cache (read only).
        num_heads: ``Hq``; dtype: the query dtype.
        block_table_width: columns of the engine's block table (``cdiv(max_model_len, N)``): the
            synthetic chunks' block tables get the same row stride and their contexts fit in it
            (None: as wide as each chunk needs).
    """
    n, d = layout.page_size, layout.head_size
    device = page_keys.device
    num_blocks = page_keys.shape[0] // layout.num_head_slots
    # sparse whatever the budget covers: a short past still reaches the small-tile variants that a
    # force_sparse config (or a tiny budget) takes while serving
    warm = dataclasses.replace(policy, dense=False, dense_below_tokens=0, force_sparse=True, sparse_prefill=True)
    gen = torch.Generator(device=device).manual_seed(0)
    steps = warmup_steps(block_table_width * n if block_table_width else None, n)
    for pol, (chunk, seq) in [(w, step) for w in (warm, scoring_policy(warm, n)) for step in steps]:
        pages = -(-seq // n)
        width = block_table_width or pages
        block_table = (torch.arange(width, device=device, dtype=torch.int32) % max(num_blocks, 1))[None, :]
        plan = plan_step(pol, n, [0, chunk], [seq])
        if not plan.any_sparse:
            continue
        query = torch.randn(chunk, num_heads, d, device=device, generator=gen).to(dtype)
        out = torch.empty_like(query)
        score_anchor = getattr(selector, "score_anchor", None)
        if score_anchor is not None:  # Kascade: the anchor's scoring, which its reuse layers read
            score_anchor(query, page_keys, block_table, layout, plan)
        selection = selector(query, page_keys, block_table, layout, plan, meta)
        tables = build_page_tables(plan, selection, block_table, layout)
        execute(query, page_keys, page_values, tables, plan, scale, out)
        if pol is not warm:  # the dense tables below do not depend on the budget: warmed once
            continue
        # the tables of steps without a sparse row (one table shared by the layers)
        dense_plan = plan_step(dataclasses.replace(pol, dense=True, force_sparse=False), n, [0, chunk], [seq])
        dense_sel = empty_selection(dense_plan, layout.num_kv_heads, device)
        execute(query, page_keys, page_values, build_page_tables(dense_plan, dense_sel, block_table, layout),
                dense_plan, scale, out)  # fmt: skip
