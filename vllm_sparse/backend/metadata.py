"""Per-step metadata and its builder: the step's decode block, its prefill plans, the executor's plan.

The builder runs once per scheduler step for all layers of a KV-cache group, on the host, from
lengths the scheduler already knows (work O(requests), nothing per layer):

* decodes come first in the batch (``reorder_batch_threshold = 1``, as vLLM's FlashInfer backend
  asks); on GPUs their block is handed to the device-driven decode path: the builder writes each
  layer policy's decode columns into persistent device buffers (``decode_step.DecodeColumns``) and
  the decode kernels read every length there. That path is what vLLM captures into full CUDA
  graphs (``UNIFORM_SINGLE_TOKEN_DECODE``): one graph per batch size, replayed for any lengths;
* the other requests (prefill chunks) get a host-planned ``StepPlan`` per layer policy
  (``policy.plan_step``) with its ``StepState`` (``plan.state``, ``vllm_sparse.step_state``): the
  one object that holds what the policy's layers share during the step. Where the layers'
  executor plans per step (the FlashAttention rows' query offsets, FlashInfer's plan) that plan
  is made here, into the state, so a layer's forward only selects, builds its page tables and
  runs; the state's device parts (forced pages, the tables' forced part, the decode batch) are
  made by the first layer that reads them.

On CPUs (no graphs, native kernels per request) every request goes through the step plans.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

from vllm_sparse import stats
from vllm_sparse.backend.dense_decode import DenseDecode, DenseDecodePlan
from vllm_sparse.backend.dense_prefill import DenseRows
from vllm_sparse.backend.sparse_decode_rows import SparseDecodeRows, SparseRowsPlan
from vllm_sparse.backend.startup import load_config
from vllm_sparse.config import LayerPolicy
from vllm_sparse.cost import decode_break_even_tokens, prefill_cost
from vllm_sparse.decode_step import DecodeColumns, DecodeStep
from vllm_sparse.policy import HEAD, SELECT, TAIL, TOTAL, SparsePays, StepPlan, plan_step, split_dense_tails
from vllm_sparse.selectors import DEVICE_DECODE_METHODS
from vllm_sparse.step_state import AnchorScores


@dataclass
class SparseAttentionMetadata:
    """One step of one KV-cache group; shared by all its layers.

    Attributes:
        num_actual_tokens: tokens in this step (``query`` may be padded past it).
        decode: the decode block (requests ``[0, decode.num_reqs)``, query rows alike), run by the
            device-driven decode path; ``None`` when there is none or the platform plans every
            request on the host.
        query_start_loc: host ``[P + 1]`` query offsets of the other (prefill) requests, absolute
            in ``query``.
        seq_lens: host ``[P]`` context + query tokens of those requests.
        block_table: ``int32 [P, max_blocks]`` their block-table rows, on the device.
        slot_mapping: ``int64 [T]`` on the device.
        dense_rows: the same requests as one dense attention call (GPUs), for layers whose plan
            runs every one of them dense (``backend.dense_prefill``).
        dense_decode: the decode block's FlashAttention call (GPUs with FA3), for layers whose policy
            decodes every row dense (``backend.dense_decode``); None: those rows take the Triton kernel.
        sparse_rows: per selecting policy, the decode block's FlashAttention call after the layer's selection
            (``backend.sparse_decode_rows``, ``VLLM_SPARSE_SPARSE_DECODE=flash``); None: the Triton kernel.
    """

    num_actual_tokens: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    page_size: int
    decode: DecodeStep | None = None
    dense_rows: DenseRows | None = None
    dense_decode: DenseDecodePlan | None = None
    sparse_rows: dict[LayerPolicy, SparseRowsPlan] | None = None
    sparse_pays: SparsePays | None = None  # the prefill cost decision (``vllm_sparse.cost``)
    anchor: AnchorScores = field(default_factory=AnchorScores, repr=False)  # Kascade, every plan's state
    dense: tuple[bool, ...] = ()  # per request, True where it runs dense whatever the policy (dense tails)
    _plans: dict[LayerPolicy, StepPlan] = field(default_factory=dict, repr=False)

    @property
    def has_prefill(self) -> bool:
        return len(self.seq_lens) > 0

    def plan_for(self, policy: LayerPolicy) -> StepPlan:
        """The step plan of the prefill requests for a layer policy, computed once per step; its
        ``state`` (``StepState``) is what the layers of that policy share during the step."""
        plan = self._plans.get(policy)
        if plan is None:
            plan = self._plans[policy] = plan_step(
                policy, self.page_size, self.query_start_loc, self.seq_lens, self.sparse_pays, self.dense
            )
            plan.state.anchor = self.anchor  # one anchor buffer for the layers of every policy
        return plan


@dataclass(frozen=True)
class _StepWork:
    """What the layers of a group need prepared per step: one entry per distinct combination."""

    policy: LayerPolicy
    executor: object  # has ``prepare(plan, hkv, group, head_size, q_dtype, kv_dtype, scale, device)``
    num_kv_heads: int
    group: int
    head_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scale: float
    dense_call: bool  # the layers run all-dense plans as one dense call (nothing to plan then)


def device_decode_supported(vllm_config) -> bool:
    """Whether this engine runs decodes through the device-driven path (and so full CUDA graphs):
    a CUDA platform with Triton, a method whose selector has a device decode path
    (``selectors.DEVICE_DECODE_METHODS``) and a config that does not ask for the torch reference executor."""
    if current_platform.is_cpu() or importlib.util.find_spec("triton") is None:
        return False
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    name = getattr(backend, "name", "") or ""
    if not name.startswith("SPARSE_"):
        return True
    if name[len("SPARSE_") :].lower() not in DEVICE_DECODE_METHODS:
        return False
    try:
        return load_config(name[len("SPARSE_") :].lower(), vllm_config).config.executor != "reference"
    except Exception:  # noqa: BLE001  (invalid configs are reported at engine start, not here)
        return True


class SparseMetadataBuilder(AttentionMetadataBuilder[SparseAttentionMetadata]):
    # Full CUDA graphs for batches of decodes (one query token each); mixed batches run piecewise.
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if not device_decode_supported(vllm_config):
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        self.page_size = kv_cache_spec.block_size
        impls = self._impls(vllm_config, layer_names)
        self._work = self._step_work(vllm_config, impls, kv_cache_spec)
        self._layer_policies = Counter(policy for _, _, policy in impls)  # policy -> layers
        self._num_kv_heads = impls[0][1].num_kv_heads if impls else kv_cache_spec.num_kv_heads
        self._sparse_pays = None
        config = impls[0][1].config if impls else None
        self._dense_tail = config.dense_tail_tokens if config is not None else 0
        self._dense_below = config.dense_below_tokens if config is not None else 0
        min_sparse_decode = 0  # past tokens a step's decode rows need before their selection pays
        if impls and not current_platform.is_cpu() and torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(device)
            cost = prefill_cost(impls[0][1].config, gpu)
            if cost is not None:
                self._sparse_pays = cost.sparse_pays
            min_sparse_decode = decode_break_even_tokens(impls[0][1].config.method, gpu)
        self._decode = None
        if device_decode_supported(vllm_config) and impls:
            self._decode = DecodeColumns(
                list(self._layer_policies),
                self.page_size,
                vllm_config.scheduler_config.max_num_seqs,
                vllm_config.model_config.max_model_len,
                device,
                min_sparse_tokens=min_sparse_decode,
                num_kv_heads=self._num_kv_heads,
                anchor_scores=impls[0][1].method == "kascade",
                group_size=impls[0][1].num_heads // self._num_kv_heads,
            )
        # dense decode rows through vLLM's FlashAttention 3 (planned here once per step, shared by the layers)
        self._dense_decode = None
        impl = impls[0][1] if impls else None
        graphs = 0 if self._decode is None else vllm_config.compilation_config.max_cudagraph_capture_size or 0
        if self._decode is not None and any(p.decodes_dense for p in self._layer_policies):
            self._dense_decode = DenseDecode.create(
                impl.num_heads, self._num_kv_heads, impl.head_size, self.page_size, kv_cache_spec.dtype,
                vllm_config.scheduler_config.max_num_seqs, graphs,
                vllm_config.attention_config.flash_attn_max_num_splits_for_cuda_graph, device,
            )  # fmt: skip
        # selected decode rows through it too (lengths known here where selectors select exactly SELECT pages)
        self._sparse_rows = None
        if self._decode is not None and impl is not None:
            self._sparse_rows = SparseDecodeRows.create(
                [p for p in self._layer_policies if not p.decodes_dense and self._decode.select_caps[p] > 0],
                impl.num_heads, self._num_kv_heads, impl.head_size, self.page_size, kv_cache_spec.dtype,
                vllm_config.scheduler_config.max_num_seqs, vllm_config.model_config.max_model_len, graphs,
                vllm_config.attention_config.flash_attn_max_num_splits_for_cuda_graph, device,
                device_counts=not impl.selector.fixed_counts,
            )  # fmt: skip

    @staticmethod
    def _impls(vllm_config, layer_names) -> list[tuple[str, object, LayerPolicy]]:
        """(layer name, impl, layer policy) of the group's sparse layers."""
        out = []
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
        for name, layer in layers.items():
            impl = getattr(layer, "impl", None)
            if impl is not None and hasattr(impl, "config"):
                out.append((name, impl, impl.config.for_layer(extract_layer_index(name))))
        return out

    @staticmethod
    def _step_work(vllm_config, impls, kv_cache_spec) -> tuple[_StepWork, ...]:
        """The distinct (policy, executor, shapes) of the group's layers whose executor plans per step."""
        work = []
        q_dtype = vllm_config.model_config.dtype if vllm_config.model_config is not None else None
        for _, impl, policy in impls:
            if getattr(impl.execute, "prepare", None) is None:
                continue
            w = _StepWork(
                policy,
                impl.execute,
                impl.num_kv_heads,
                impl.num_heads // impl.num_kv_heads,
                impl.head_size,
                q_dtype,
                kv_cache_spec.dtype,
                impl.scale,
                getattr(impl, "dense_prefill", None) is not None,
            )
            if w not in work:
                work.append(w)
        return tuple(work)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> SparseAttentionMetadata:
        cm = common_attn_metadata
        b = cm.num_reqs
        # exact on decode rows: speculative decoding (whose bound is optimistic) is refused at start
        seq_t = cm.seq_lens_cpu_upper_bound
        if seq_t is None:
            seq_t = cm.seq_lens.cpu()
        # numpy views of the host tensors: slicing them costs no torch op per step
        seq_cpu = seq_t.numpy()[:b]
        qsl = cm.query_start_loc_cpu.numpy()[: b + 1]
        nd = 0
        if self._decode is not None:  # the leading requests of at most one query token (0: padding)
            q_lens = qsl[1:] - qsl[:-1]
            nd = b if q_lens.max(initial=0) <= 1 else int(np.argmax(q_lens > 1))
        decode = None
        if nd:
            decode = self._decode.write(seq_cpu[:nd], cm.block_table_tensor)
            self._count_decode(decode)
        dense_decode = None
        if decode is not None and self._dense_decode is not None:
            dense_decode = self._dense_decode.plan(cm.seq_lens[:nd], int(seq_cpu[:nd].max()))
        sparse_rows = None
        if decode is not None and self._sparse_rows is not None:
            sparse_rows = self._sparse_rows.plan(decode)
        meta = SparseAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=qsl[nd:].tolist(),
            seq_lens=seq_cpu[nd:].tolist(),
            block_table=cm.block_table_tensor[nd:b],
            slot_mapping=cm.slot_mapping,
            page_size=self.page_size,
            decode=decode,
            dense_decode=dense_decode,
            sparse_rows=sparse_rows,
            sparse_pays=self._sparse_pays,
        )
        if meta.has_prefill and self._decode is not None:  # GPUs: the dense call of the prefill rows
            q_lens = qsl[nd + 1 :] - qsl[nd:-1]
            meta.dense_rows = DenseRows(
                token_start=int(qsl[nd]),
                num_tokens=int(qsl[b] - qsl[nd]),
                query_start=cm.query_start_loc[nd : b + 1] - int(qsl[nd]),
                seq_lens=cm.seq_lens[nd:b],
                block_table=meta.block_table,
                max_query_len=int(q_lens.max()),
                max_seq_len=int(seq_cpu[nd:b].max()),
            )
        if meta.has_prefill and self._dense_tail:
            self._split_dense_tails(meta)
        if meta.has_prefill:
            for w in self._work:  # plan once per step, here, for every layer of the group (into plan.state)
                plan = meta.plan_for(w.policy)
                if plan.requests and not (w.dense_call and not plan.any_sparse):
                    w.executor.prepare(
                        plan, w.num_kv_heads, w.group, w.head_size, w.q_dtype, w.kv_dtype, w.scale, self.device
                    )
        return meta

    def _split_dense_tails(self, meta: SparseAttentionMetadata) -> None:
        """Each sparse prefill chunk's last ``dense_tail_tokens`` queries as a dense request of their own,
        on a copy of the chunk's block-table row (``policy.split_dense_tails``)."""
        split = split_dense_tails(meta.query_start_loc, meta.seq_lens, self._dense_tail, self._dense_below)
        if split is None:
            return
        meta.query_start_loc, meta.seq_lens, meta.dense = split.query_start_loc, split.seq_lens, split.dense
        if len(split.rows) != meta.block_table.shape[0]:
            rows = torch.tensor(split.rows, dtype=torch.long).to(meta.block_table.device, non_blocking=True)
            meta.block_table = meta.block_table.index_select(0, rows)

    def _count_decode(self, decode: DecodeStep) -> None:
        """Page counters of the decode rows (the decode forward may replay from a CUDA graph, where
        no Python runs): planned counts, an upper bound for top-p selectors."""
        if not stats.enabled():
            return
        hkv = self._num_kv_heads
        for policy, layers in self._layer_policies.items():
            c = decode.host_columns[policy]
            attended = c[:, SELECT] + c[:, HEAD] + c[:, TOTAL] - c[:, TAIL]
            stats.record(
                hkv * int(((c[:, SELECT] > 0) | (c[:, TAIL] > 0)).sum()) * layers,
                hkv * int(attended.sum()) * layers,
                hkv * int(c[:, TOTAL].sum()) * layers,
                steps=layers,
            )
        stats.flush()
