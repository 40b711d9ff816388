"""Kascade: exact top pages at a few anchor layers, reused by the layers between them.

Per step, an anchor layer (layer 0, dense, is always one) computes the exact post-softmax weights
of the step's queries over every past key and pools them (``kernels.anchor_mass``: decode over the
G query heads of a KV head, prefill over tiles of ``tile`` queries and the G heads, each tile
leaving out its own diagonal keys), summed per past page; it writes that mass per (request, KV
head) into the step's anchor buffer (``step_state.AnchorScores``, on the device). Every layer from
the anchor up to the next anchor, the anchor included, then keeps the top ``plan.num_select``
non-forced pages of that mass, its KV head ``h`` reading the anchor's KV head ``head_map[h]``
(calibrated, ``vllm-sparse calibrate``; identity where absent). The buffer lives on the device
from layer to layer: no host round trip.

Differences from the paper: pages, not tokens (a page is as heavy as the mass of its keys); one
page set per (request, KV head) for a whole prefill chunk (the largest over the chunk's tiles of
each tile's pooled mass) instead of one per tile; tiles of 32 queries by default (the paper: 128);
sink and local pages are forced on top; the budget is the config's (the paper: max(128, 10%)).
An explicit ``chunk_query_window: W`` makes an anchor score a prefill chunk with its last ``W``
queries only, as Quest and Twilight do by default (the paper, and the default here: every query);
``kascade.tile_stride: S`` makes it score the chunk's last tile and every ``S``-th tile before it, a
sample spread over the whole chunk at ``1/S`` of the anchors' prefill cost (default 1: every tile).
An anchor scores every request that a later layer may run sparse (past the config's
``dense_below_tokens``), whether or not the anchor's own layer runs it sparse.
"""

from __future__ import annotations

import torch

from vllm_sparse.config import KascadeOptions, LayerPolicy, SparseConfig
from vllm_sparse.decode_step import DecodeStep
from vllm_sparse.kernels.anchor_mass import TILE, anchor_page_mass
from vllm_sparse.layout import PageLayout, PageMeta
from vllm_sparse.policy import RequestPlan, StepPlan
from vllm_sparse.selectors.base import Selection, chunk_queries, empty_selection, past_page_ids


def _use_triton(q: torch.Tensor, page_size: int) -> bool:
    return q.is_cuda and page_size & (page_size - 1) == 0


def _use_native(q: torch.Tensor, page_keys: torch.Tensor) -> bool:
    """Whether the native CPU kernel scores (``kernels.cpu_native``: CPU tensors, library loaded)."""
    from vllm_sparse.kernels import cpu_native

    return cpu_native.usable(q, page_keys)


def anchor_queries(query: torch.Tensor, req: RequestPlan, window: int | None) -> tuple[torch.Tensor, int]:
    """The queries an anchor scores request ``req`` with (``query [T, Hq, D]``) and the position of
    the first: ``(q [C, Hq, D], context)``, the chunk's queries or only its last ``window`` of them
    (None: every query), and ``context`` the tokens before ``q[0]`` (the chunk's earlier keys
    included, which the windowed queries still attend)."""
    q = chunk_queries(query, req, window)  # [C, Hq, D], the last C queries of the chunk
    return q, req.context_len + req.query_len - q.shape[0]


def score_request(
    query: torch.Tensor, page_keys: torch.Tensor, block_table: torch.Tensor, layout: PageLayout,
    r: int, req: RequestPlan, scale: float, tile: int = TILE, window: int | None = None, stride: int = 1,
) -> torch.Tensor:  # fmt: skip
    """``float32 [Hkv, P_past]`` the anchor mass of request ``r`` of a plan (``query [T, Hq, D]``,
    ``block_table int [B, max_blocks]``): the Triton kernel on CUDA, the native kernel on CPUs where it
    builds (``kernels.cpu_native.anchor_page_mass``), else the torch twin.

    ``window``: score with the chunk's last ``window`` queries only (``chunk_query_window``; None:
    every query, the paper's rule). Those queries still attend every key before them, the chunk's
    earlier keys included, and their tiles start at the window's first query. ``stride``: score the
    last tile and every ``stride``-th before it (``kascade.tile_stride``, ``anchor_mass.scored_tiles``)."""
    q, context = anchor_queries(query, req, window)
    pages = -(-(req.context_len + req.query_len - 1) // layout.page_size)
    ids = past_page_ids(block_table, r, pages, layout)  # [Hkv, pages]
    if _use_triton(q, layout.page_size):
        from vllm_sparse.kernels.anchor_mass import anchor_page_mass_triton

        mass = anchor_page_mass_triton(q, page_keys, ids, context, scale, tile, stride)
    elif _use_native(q, page_keys):
        from vllm_sparse.kernels import cpu_native

        mass = cpu_native.anchor_page_mass(q, page_keys, ids, context, scale, tile, stride)
    else:
        mass = anchor_page_mass(q, page_keys, ids, context, scale, tile, stride)
    return mass[:, : req.context_len // layout.page_size]  # the chunk's own pages are not past pages


class KascadeSelector:
    fixed_counts = True  # exactly num_select pages per sparse row

    def __init__(self, config: SparseConfig, scale: float | None = None, layer: int | None = None,
                 num_layers: int | None = None, kv_heads: list[int] | None = None):  # fmt: skip
        """Bound to one layer (``for_layer``) before it selects: ``layer`` of ``num_layers``;
        ``kv_heads``: the model's KV heads this worker holds under tensor parallelism (None: all)."""
        self.config = config
        self.options: KascadeOptions = config.kascade
        self.query_window = config.query_window()  # anchors of prefill chunks score their last W queries
        self.scale = scale
        self.layer = layer
        self.num_layers = num_layers
        self.anchor = self.is_anchor = None
        self.head_map: list[int] | None = None
        self._head_map_dev: torch.Tensor | None = None
        if layer is not None:
            anchors = self.options.anchor_layers(num_layers or layer + 1)
            self.is_anchor = layer in anchors
            self.anchor = max((a for a in anchors if a <= layer), default=0)
            self.head_map = self.options.local_head_map(layer, kv_heads)

    def _heads(self, device: torch.device) -> torch.Tensor | None:
        """``int64 [Hkv]`` the head map on ``device`` (copied once: no copy per step), or None."""
        if self.head_map is None:
            return None
        if self._head_map_dev is None or self._head_map_dev.device != device:
            self._head_map_dev = torch.tensor(self.head_map, dtype=torch.int64, device=device)
        return self._head_map_dev

    def for_layer(self, layer: int, num_layers: int, kv_heads: list[int] | None = None) -> KascadeSelector:
        """This selector bound to ``layer`` (its anchor, and its head map over ``kv_heads``, the
        model's KV heads of this worker in local order; None: every KV head)."""
        return KascadeSelector(self.config, self.scale, layer, num_layers, kv_heads)

    def _scored(self, req: RequestPlan) -> bool:
        """Whether an anchor scores ``req``: its own layer or a later one may run it sparse."""
        c = self.config
        if req.sparse:
            return True
        if req.num_past_pages == 0 or req.context_len < c.dense_below_tokens:
            return False
        if req.query_len == 1:
            return c.may_decode_sparse()
        return c.sparse_prefill is not False

    def observe(self, query: torch.Tensor, page_keys: torch.Tensor, block_table: torch.Tensor,
                layout: PageLayout, plan: StepPlan) -> None:  # fmt: skip
        """Every layer, every step, before it attends (sparse or dense): an anchor layer scores the
        step's requests into the step's anchor buffer; other layers do nothing."""
        if self.is_anchor:
            self.score_anchor(query, page_keys, block_table, layout, plan)

    def score_anchor(self, query: torch.Tensor, page_keys: torch.Tensor, block_table: torch.Tensor,
                     layout: PageLayout, plan: StepPlan) -> None:  # fmt: skip
        """Write the anchor mass of every scored request of ``plan`` into ``plan.state.anchor``
        (``query [T, Hq, D]``, ``page_keys [num_pages, N, D]``, ``block_table int [B, max_blocks]``)."""
        buf = plan.state.on(block_table, layout).anchor
        scale = self.scale or query.shape[-1] ** -0.5
        o = self.options
        buf.mass = [
            score_request(
                query, page_keys, block_table, layout, r, req, scale, o.tile, self.query_window, o.tile_stride
            )
            if self._scored(req)
            else None
            for r, req in enumerate(plan.requests)
        ]
        buf.layer = self.anchor if self.anchor is not None else 0

    def __call__(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        block_table: torch.Tensor,
        layout: PageLayout,
        plan: StepPlan,
        meta: PageMeta | None = None,
    ) -> Selection:
        """See ``selectors.base.Selector``: per sparse request and KV head ``h``, the top
        ``num_select`` non-forced past pages of the anchor's mass of KV head ``head_map[h]``;
        rows ``B * Hkv`` with ``counts == num_select``."""
        hkv = layout.num_kv_heads
        state = plan.state.on(block_table, layout)
        buf = state.anchor
        if self.anchor is not None and buf.layer != self.anchor:
            raise RuntimeError(
                f"sparse_kascade: layer {self.layer} reuses anchor layer {self.anchor}, which did not "
                f"score this step (the step's anchor buffer holds layer {buf.layer})"
            )
        heads = self._heads(query.device)
        sel = empty_selection(plan, hkv, query.device)
        for r, req in enumerate(plan.requests):
            if not req.sparse or req.num_select == 0:
                continue
            mass = buf.mass[r] if r < len(buf.mass) else None
            if mass is None:
                raise RuntimeError(f"sparse_kascade: request {r} is sparse in layer {self.layer} but was not scored")
            if heads is not None:
                mass = mass.index_select(0, heads)  # reuse KV head h reads anchor head head_map[h]
            mass = mass.index_fill(1, state.forced_past[r], float("-inf"))
            rows = slice(r * hkv, (r + 1) * hkv)
            sel.indices[rows, : req.num_select] = torch.topk(mass, req.num_select, dim=1).indices
            sel.counts[rows] = req.num_select
        return sel

    def observe_decode(self, query: torch.Tensor, page_keys: torch.Tensor, layout: PageLayout,
                       step: DecodeStep) -> None:  # fmt: skip
        """Every layer of a decode block on the device path, before it attends (sparse or dense): an
        anchor layer writes the anchor mass of every decode row into ``step.anchor`` (``query
        [>= B, Hq, D]``; ``kernels.anchor_mass_decode``, one read of the keys); other layers do
        nothing. No host sync."""
        if not self.is_anchor:
            return
        if step.anchor_work is None:
            raise RuntimeError(
                "sparse_kascade: the decode step has no anchor buffer (DecodeColumns(anchor_scores=True))"
            )
        from vllm_sparse.kernels.anchor_mass_decode import anchor_decode_mass_triton

        cols = next(iter(step.columns.values()))  # TOTAL, LAST and PAST: the same for every policy
        scale = self.scale or query.shape[-1] ** -0.5
        anchor_decode_mass_triton(query[: step.num_reqs], page_keys, step.block_table, cols,
                                  layout.num_kv_heads, layout.num_head_slots, scale, step.anchor_work)  # fmt: skip
        if step.anchor_pick is not None:  # new scores: the next layer that selects runs the top-k
            step.anchor_pick.layer = None

    def select_decode(self, query: torch.Tensor, page_keys: torch.Tensor, layout: PageLayout,
                      meta: PageMeta | None, step: DecodeStep, policy: LayerPolicy):  # fmt: skip
        """See ``selectors.base.Selector.select_decode``: the best ``SELECT`` pages of each row's
        ``[HEAD, TAIL)`` by the step's anchor mass (``observe_decode`` of the layer's anchor), KV
        head ``h`` reading the anchor's head ``head_map[h]``.

        The top-k runs once per anchor, policy and step, over the anchor's own heads
        (``DecodeStep.anchor_pick``); each layer then gathers its rows through its head map, which
        gives what a top-k over the mapped scores would (the same rows, the same columns).
        """
        from vllm_sparse.kernels.page_topk import select_top_pages_triton

        hkv, b = layout.num_kv_heads, step.num_reqs
        pick = step.anchor_pick
        if pick is None or not pick.holds(self.anchor, policy):
            pages, counts = select_top_pages_triton(
                step.anchor, step.columns[policy], hkv, step.select_caps[policy], counters=step.topk_counters
            )
            if pick is not None:
                pick.layer, pick.policy, pick.pages, pick.counts = self.anchor, policy, pages, counts
        else:
            pages, counts = pick.pages, pick.counts
        heads = self._heads(pages.device)
        if heads is None:
            return pages, counts
        # reuse KV head h reads anchor head head_map[h]
        return (pages.view(b, hkv, -1).index_select(1, heads).reshape(b * hkv, -1),
                counts.view(b, hkv).index_select(1, heads).reshape(b * hkv))  # fmt: skip
