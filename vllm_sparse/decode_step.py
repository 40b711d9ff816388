"""The decode block of a scheduler step, as the device-driven decode path reads it.

Decodes come first in a batch (the builder asks vLLM to reorder them there), so a step's requests
with one query token are one contiguous block: query rows ``[0, B)``, block-table rows ``[0, B)``.
Everything the decode kernels read lives in device buffers whose addresses and shapes depend only
on ``B`` (and on caps fixed at engine start): the host writes their contents once per step, before
any kernel runs, and the kernels read every length on the device. So the decode path captures
into a CUDA graph once per batch size and replays for any lengths, and in eager mode it costs a
fixed handful of launches per layer, whatever the batch holds.

Per layer policy (``LayerPolicy``) the step carries ``int32 [B, NUM_COLUMNS]`` columns
(``policy.decode_columns``: pages to select, forced ranges, lengths); rows ``b * Hkv + h`` of the
kernels are (request, KV head) pairs. Padding rows of a CUDA-graph batch have ``seq_len = 0`` and
attend nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from vllm_sparse.config import LayerPolicy
from vllm_sparse.policy import NUM_COLUMNS, decode_columns, select_cap

#: Largest host table of decode columns (``DecodeColumns._column_tables``): 2 x P x (max_model_len + 1)
#: rows of 24 bytes, 12.6 MB for two policies at 128K.
TABLE_BYTES = 64 << 20


@dataclass
class AnchorPick:
    """The top pages that the step's anchor scores gave (Kascade), kept for the layers that share them.

    The first layer of a step that selects from an anchor's scores (``DecodeStep.anchor``) runs the
    top-k over the anchor's own KV heads and leaves the result here; every later layer of the same
    anchor and policy reads it through its head map instead of selecting again: one top-k per anchor
    and step, not one per layer. An anchor's new scores void it (a forward pass run twice on one
    step, as a CUDA-graph capture after its warm-up run, selects afresh each time).
    ``pages int32 [B * Hkv, K_cap]`` and ``counts int32 [B * Hkv]`` as
    ``kernels.page_topk.select_top_pages_triton`` returns them.
    """

    layer: int | None = None
    policy: LayerPolicy | None = None
    pages: torch.Tensor | None = None
    counts: torch.Tensor | None = None

    def holds(self, layer: int, policy: LayerPolicy) -> bool:
        """Whether this is the pick of anchor ``layer`` under ``policy``."""
        return self.pages is not None and self.layer == layer and self.policy == policy


@dataclass(frozen=True)
class DecodeStep:
    """The decode block of one step (one query token per request).

    Attributes:
        num_reqs: ``B`` decode requests (CUDA-graph padding rows included).
        page_size: ``N`` tokens per page.
        block_table: ``int32 [B, max_blocks]`` the decode requests' block-table rows (device).
        columns: per layer policy, ``int32 [B, NUM_COLUMNS]`` on the device (a view of a
            persistent buffer: the same address for the same ``B`` every step).
        host_columns: the same on the host (counters; never read by kernels).
        page_cap: ``P_cap`` past pages a request can have (from ``max_model_len``).
        select_caps: per layer policy, ``K_cap`` pages a row can be asked to select.
        no_pages, no_counts: ``int32 [B * Hkv, 1]`` and ``int32 [B * Hkv]`` zeros (views of
            persistent buffers): the selection of layers that decode dense, so that those layers
            launch no fill kernels of their own.
        anchor: ``float32 [B * Hkv, P_cap]`` (a view of a persistent buffer) where an anchor layer
            leaves its page scores for the layers up to the next anchor (Kascade), or None.
        anchor_work: ``float32 [B * Hkv, G, P_cap]`` the anchor scoring's workspace (per page and
            query head of the group); ``anchor`` is its head-0 plane.
        anchor_pick: the top pages of those scores once a layer has selected from them (with
            ``anchor``; a fresh one every step).
        topk_counters: ``int32 [2 * B * Hkv]`` zeros (a view of a persistent buffer) in which the
            one-launch top-k's row barriers count and which it leaves zero
            (``kernels.page_topk.select_top_pages_triton``'s ``counters``).
    """

    num_reqs: int
    page_size: int
    block_table: torch.Tensor
    columns: dict[LayerPolicy, torch.Tensor]
    host_columns: dict[LayerPolicy, np.ndarray]
    page_cap: int
    select_caps: dict[LayerPolicy, int]
    no_pages: torch.Tensor | None = None
    no_counts: torch.Tensor | None = None
    anchor: torch.Tensor | None = None
    anchor_pick: AnchorPick | None = None
    anchor_work: torch.Tensor | None = None
    topk_counters: torch.Tensor | None = None

    def selects(self, policy: LayerPolicy) -> bool:
        """Whether rows of ``policy`` may select pages at all (a static property of the policy,
        never of the step's data, so that the launches of a captured graph fit every replay)."""
        return not policy.decodes_dense and self.select_caps[policy] > 0


class DecodeColumns:
    """Persistent device buffers of the decode columns of every layer policy of a KV-cache group.

    Allocated once (``max_reqs`` rows per policy), rewritten in place every step from the host:
    a CUDA graph captured for ``B`` decode rows reads ``buffer[policy][:B]`` at fixed addresses.

    ``min_sparse_tokens`` (``cost.decode_break_even_tokens``): a step whose decode rows add up to
    fewer past tokens decodes dense (selection costs more than it saves there); the rows' columns say
    so, so the captured graphs stay the same and their selection kernels find nothing to select.
    It applies to the policies whose decode is decided by cost (``LayerPolicy.decode_by_cost``:
    the config leaves ``sparse_decode`` to the method), not to those that ask for sparse decode.

    ``anchor_scores``: also keep a ``float32 [max_reqs * Hkv, group_size, P_cap]`` workspace whose
    head-0 plane holds the page scores that layers of a step hand on to later layers (Kascade's
    anchors; ``DecodeStep.anchor``). ``group_size``: the query heads ``G`` of a KV head.
    """

    def __init__(
        self,
        policies: list[LayerPolicy],
        page_size: int,
        max_reqs: int,
        max_model_len: int,
        device: torch.device,
        min_sparse_tokens: int = 0,
        num_kv_heads: int = 1,
        anchor_scores: bool = False,
        group_size: int = 1,
    ):
        self.policies = list(dict.fromkeys(policies))
        self.page_size = page_size
        self.max_reqs = max_reqs
        self.page_cap = max_model_len // page_size + 1
        self.select_caps = {p: select_cap(p, page_size, max_model_len) for p in self.policies}
        self.device = torch.device(device)
        self._device = torch.zeros(len(self.policies), max_reqs, NUM_COLUMNS, dtype=torch.int32, device=device)
        self._index = {p: i for i, p in enumerate(self.policies)}
        self.min_sparse_tokens = min_sparse_tokens
        self._dense = {p: dataclasses.replace(p, sparse_decode=False) for p in self.policies}
        self.num_kv_heads = num_kv_heads
        self._no_pages = torch.zeros(max_reqs * num_kv_heads, 1, dtype=torch.int32, device=device)
        self._no_counts = torch.zeros(max_reqs * num_kv_heads, dtype=torch.int32, device=device)
        self._topk_counters = torch.zeros(2 * max_reqs * num_kv_heads, dtype=torch.int32, device=device)
        self._anchor = None
        if anchor_scores:
            shape = (max_reqs * num_kv_heads, group_size, self.page_cap)
            self._anchor = torch.zeros(shape, dtype=torch.float32, device=device)
        self._tables = self._column_tables(max_model_len)
        self._views: dict[int, dict] = {}
        # host staging of ``_device``: on CUDA two pinned buffers in turn, each reused only once the copy that
        # last read it has run (its event), so a step allocates no pinned memory and never overwrites a copy in flight
        shape = tuple(self._device.shape)
        pinned = self.device.type == "cuda"
        self._staging = [torch.zeros(shape, dtype=torch.int32, pin_memory=pinned) for _ in range(2 if pinned else 1)]
        self._staging_host = [t.numpy() for t in self._staging]
        self._staged = [torch.cuda.Event() if pinned else None for _ in self._staging]
        self._turn = 0

    def _column_tables(self, max_model_len: int) -> np.ndarray | None:
        """``int32 [2, P, L, NUM_COLUMNS]``: ``policy.decode_columns`` of every sequence length
        ``0 .. L - 1`` (``L`` = ``max_model_len + 1``) for each policy (``[0]``) and for the dense
        variant the cost rule switches it to (``[1]``), so that a step's columns are one lookup instead
        of some thirty array operations per policy (host time per step, which async scheduling hides behind
        the GPU: session 32). None past ``TABLE_BYTES`` (``write`` then computes the columns)."""
        length = max_model_len + 1
        if 2 * len(self.policies) * length * NUM_COLUMNS * 4 > TABLE_BYTES:
            return None
        seq = np.arange(length, dtype=np.int64)
        tables = np.stack([
            np.stack([decode_columns(p, self.page_size, seq) for p in self.policies]),
            np.stack([decode_columns(self._dense[p] if p.decode_by_cost else p, self.page_size, seq)
                      for p in self.policies]),
        ])  # fmt: skip
        for p, i in self._index.items():
            top = int(tables[:, i, :, 0].max())
            if top > self.select_caps[p]:
                raise AssertionError(f"a decode row selects {top} pages, above the cap {self.select_caps[p]}")
        return tables

    def _views_of(self, b: int) -> dict:
        """The device views a step of ``b`` decode rows hands its kernels, made once per ``b``."""
        views = self._views.get(b)
        if views is None:
            h = self.num_kv_heads
            views = self._views[b] = dict(
                columns={p: self._device[i, :b] for p, i in self._index.items()},
                no_pages=self._no_pages[: b * h],
                no_counts=self._no_counts[: b * h],
                anchor=None if self._anchor is None else self._anchor[: b * h, 0],
                anchor_work=None if self._anchor is None else self._anchor[: b * h],
                topk_counters=self._topk_counters[: 2 * b * h],
            )
        return views

    def _stage(self, host: np.ndarray) -> None:
        """Copy ``host`` (``int32`` shaped as ``_device``) to the device asynchronously."""
        i = self._turn = (self._turn + 1) % len(self._staging)
        event = self._staged[i]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer (two steps ago) has run
        self._staging_host[i][...] = host
        self._device.copy_(self._staging[i], non_blocking=event is not None)
        if event is not None:
            event.record()

    def write(self, seq_lens: np.ndarray, block_table: torch.Tensor) -> DecodeStep:
        """Columns of ``B = len(seq_lens)`` decode requests for every policy, copied to the device
        (pinned staging, one asynchronous copy; rows past ``B`` are zeroed: padding).

        Args:
            seq_lens: ``int [B]`` context + 1 per decode request (0: padding row).
            block_table: ``int32 [>= B, max_blocks]`` the step's block table (device).
        """
        b = len(seq_lens)
        if b > self.max_reqs:
            raise ValueError(f"{b} decode requests exceed the {self.max_reqs} the buffers were sized for")
        seq = np.asarray(seq_lens, dtype=np.int64)
        host = np.zeros((len(self.policies), self.max_reqs, NUM_COLUMNS), dtype=np.int32)
        below = int(np.maximum(seq - 1, 0).sum()) < self.min_sparse_tokens
        if self._tables is not None and b and int(seq.max()) < self._tables.shape[2]:
            host[:, :b] = self._tables[int(below)][:, seq]
        else:
            for p, i in self._index.items():
                cols = decode_columns(self._dense[p] if below and p.decode_by_cost else p, self.page_size, seq)
                cap = self.select_caps[p]
                if cols.shape[0] and int(cols[:, 0].max()) > cap:
                    raise AssertionError(f"a decode row selects {int(cols[:, 0].max())} pages, above the cap {cap}")
                host[i, :b] = cols
        self._stage(host)
        views = self._views_of(b)
        return DecodeStep(
            num_reqs=b,
            page_size=self.page_size,
            block_table=block_table[:b],
            columns=dict(views["columns"]),
            host_columns={p: host[i, :b] for p, i in self._index.items()},
            page_cap=self.page_cap,
            select_caps=self.select_caps,
            no_pages=views["no_pages"],
            no_counts=views["no_counts"],
            anchor=views["anchor"],
            anchor_pick=None if self._anchor is None else AnchorPick(),
            anchor_work=views["anchor_work"],
            topk_counters=views["topk_counters"],
        )
