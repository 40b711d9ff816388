"""The attention impl: the pipeline stages of one layer (write, policy, select, tables, execute; README "How it works")."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from vllm_sparse import stats
from vllm_sparse.backend import meta_check
from vllm_sparse.backend.dense_decode import run_dense_decode
from vllm_sparse.backend.metadata import SparseAttentionMetadata
from vllm_sparse.backend.sparse_decode_rows import run_sparse_rows
from vllm_sparse.backend.startup import load_config
from vllm_sparse.config import kv_heads_of_rank
from vllm_sparse.decode_step import DecodeStep
from vllm_sparse.executors import get_executor, reference_executor
from vllm_sparse.layout import MetaPlanes, PageLayout, PageMeta
from vllm_sparse.metadata import get_decode_step_writer, get_kv_writer
from vllm_sparse.metadata.int4_shadow import write_int4_shadow
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.selectors import make_selector
from vllm_sparse.tables import build_page_tables

logger = logging.getLogger("vllm_sparse")


def _decode_only_step(layer) -> bool:
    """Whether this step's tokens are all decodes (one per request, the CUDA-graph case), so
    that no two written slots share a page (``kernels.kv_write``)."""
    if not is_forward_context_available():
        return False
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer.layer_name)
    return isinstance(metadata, SparseAttentionMetadata) and metadata.decode is not None and not metadata.has_prefill


@dataclass(frozen=True)
class CacheViews:
    """A layer cache's layout and views, kept while the cache tensor (``key``) stays the same."""

    key: tuple
    layout: PageLayout
    page_keys: torch.Tensor  # [num_pages, N, D] strided view
    page_values: torch.Tensor  # [num_pages, N, D] strided view
    keys: torch.Tensor  # [num_blocks, Hkv, N, D] strided view
    values: torch.Tensor  # [num_blocks, Hkv, N, D] strided view
    meta: PageMeta | None


class SparseAttentionImpl(AttentionImpl[SparseAttentionMetadata]):
    method: str

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra_impl_args,
    ) -> None:
        unsupported = [
            name
            for name, present in (
                ("ALiBi", alibi_slopes is not None),
                ("sliding window", sliding_window is not None),
                ("logits soft cap", bool(logits_soft_cap)),
                ("attention sinks", extra_impl_args.get("sinks") is not None),
                (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
            )
            if present
        ]
        if unsupported:
            raise NotImplementedError(f"sparse_{self.method} does not support: {', '.join(unsupported)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        vllm_config = get_current_vllm_config()
        self.config = load_config(self.method, vllm_config).config
        self.selector = make_selector(self.config, self.scale)
        device_type = "cpu" if current_platform.is_cpu() else "cuda"
        self.kv_order = "planes" if device_type == "cpu" else "interleaved"
        self.write_kv = get_kv_writer(device_type)
        self.write_decode_step = get_decode_step_writer(device_type)  # None: no fused decode write
        # vLLM settles the block size after the model is built (a backend's preferred block size,
        # ``SparseBackend.get_preferred_block_size``): read it, and pick what depends on it, on first use
        self._cache_config = vllm_config.cache_config
        self._device_type = device_type
        self.max_model_len = mc.max_model_len if (mc := vllm_config.model_config) is not None else 0
        if device_type == "cpu":
            from vllm_sparse.kernels import cpu_native

            cpu_native.available()  # build or load the native CPU ops now, not in the first forward
        mc = vllm_config.model_config
        self.last_layer = mc.get_total_num_hidden_layers() - 1 if mc is not None else -1
        self.model_kv_heads = self._model_kv_heads(vllm_config)
        self.layer_idx: int | None = None
        self._warm = False  # this layer's sparse prefill kernels compiled (see _warm_up_once)
        self._cached_views: CacheViews | None = None

    @property
    def block_size(self) -> int:
        """Tokens per KV page, as vLLM runs the engine (read when used, never cached)."""
        return self._cache_config.block_size

    @functools.cached_property
    def execute(self):
        """This layer's executor (``_pick_executor``), chosen on first use, once the block size is settled."""
        return self._pick_executor(self._device_type)

    @functools.cached_property
    def dense_prefill(self):
        """Dense prefill steps at FLASH_ATTN's cost (GPUs with vLLM's FlashAttention), else None."""
        if self._device_type != "cuda" or self.config.executor == "reference":
            return None
        from vllm_sparse.backend.dense_prefill import DensePrefill

        return DensePrefill.create(self.head_size, self.block_size)

    def _model_kv_heads(self, vllm_config) -> list[int] | None:
        """The model's KV heads this worker holds, in its local order, under tensor parallelism
        (None without it); its page counters go to a file of its own (``stats.set_rank``)."""
        tp = vllm_config.parallel_config.tensor_parallel_size
        mc = vllm_config.model_config
        if tp <= 1 or mc is None:
            return None
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
        stats.set_rank(rank)
        heads = kv_heads_of_rank(mc.get_total_num_kv_heads(), tp, rank)
        if len(heads) != self.num_kv_heads:
            raise RuntimeError(
                f"sparse_{self.method}: tensor-parallel rank {rank} of {tp} has {self.num_kv_heads} KV heads, "
                f"not the {len(heads)} of the model's {mc.get_total_num_kv_heads()} that vLLM's sharding gives it"
            )
        return heads

    def _pick_executor(self, device_type: str):
        """vLLM's CPU kernel over page rows on CPU (head size a multiple of 32), else the platform's.

        On GPUs, vLLM's FlashAttention over the rows (``backend.flash_rows``: every method, the
        rows' lengths read on the device) where vLLM ships it for this GPU; else FlashInfer, which
        plans fixed page counts per row, and for a selector whose rows vary (``fixed_counts =
        False``: Twilight's top-p) the Triton paged executor, which reads each row's length on the
        device (the torch reference executor, correct and slow, where triton is missing).
        """
        if self.config.executor == "reference":
            return reference_executor
        if device_type == "cpu" and self.head_size % 32 == 0:
            from vllm_sparse.backend.cpu_attn_executor import CpuAttnExecutor

            return CpuAttnExecutor()
        if device_type == "cuda":
            from vllm_sparse.backend.flash_rows import FlashRowsExecutor

            rows = FlashRowsExecutor.create(self.head_size, self.block_size)
            if rows is not None:
                return rows
        if device_type == "cuda" and not self.selector.fixed_counts:
            import importlib.util

            if importlib.util.find_spec("triton") is not None:
                from vllm_sparse.executors.triton_paged import TritonPagedExecutor

                return TritonPagedExecutor()
            logger.warning(
                "vllm-sparse: triton is not installed; sparse_%s runs the torch reference executor", self.method
            )
            return reference_executor
        return get_executor(device_type)

    def _views(self, kv_cache: torch.Tensor) -> CacheViews:
        """The layout of ``kv_cache`` and its strided views (keys and values by page id, metadata
        planes), made once per cache tensor: vLLM keeps a layer's cache for the engine's life."""
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        views = self._cached_views
        if views is None or views.key != key:
            layout = PageLayout.of(kv_cache, self.num_kv_heads, self.kv_order)
            planes = MetaPlanes.for_method(
                self.method, layout.num_kv_heads, layout.page_size, layout.head_size, kv_cache.dtype
            )
            views = self._cached_views = CacheViews(
                key,
                layout,
                layout.page_keys(kv_cache),
                layout.page_values(kv_cache),
                layout.keys(kv_cache),
                layout.values(kv_cache),
                None if planes is None else planes.views(kv_cache),  # None: the method keeps no metadata
            )
        return views

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Stage 0: write this step's K/V (``[T, Hkv, D]``) into ``kv_cache`` at ``slot_mapping``,
        then the page metadata of every touched page (methods that keep it)."""
        if self.kv_sharing_target_layer_name is not None:
            return
        views = self._views(kv_cache)
        layout, meta = views.layout, views.meta
        if self.write_decode_step is not None and _decode_only_step(layer):
            self.write_decode_step(layout, kv_cache, meta, key, value, slot_mapping)  # one launch
        else:
            self.write_kv(layout, kv_cache, key, value, slot_mapping)
            if meta is not None and meta.kmin is not None:
                write_page_minmax(layout, kv_cache, meta, slot_mapping)
            if meta is not None and meta.codes is not None:
                write_int4_shadow(meta, key, slot_mapping, layout.page_size, kv_cache.dtype)
        if meta is None:
            return
        if meta_check.ENABLED and not meta_check.capturing(kv_cache):  # debug only (off by default)
            meta_check.check_written(layer.layer_name, layout, kv_cache, meta, slot_mapping)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: SparseAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, Hq, D]``, kv_cache ``[num_blocks, head_slots, N, 2D]``, output ``[T, Hq, D]``."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by vllm-sparse")
        if self.layer_idx is None:
            self.layer_idx = extract_layer_index(layer.layer_name)
            self.policy = self.config.for_layer(self.layer_idx)
            if hasattr(self.selector, "for_layer"):  # selectors that depend on the layer (Kascade's anchors)
                self.selector = self.selector.for_layer(self.layer_idx, self.last_layer + 1, self.model_kv_heads)
        if not self._warm and query.is_cuda and not torch.cuda.is_current_stream_capturing():
            # vLLM's memory-profiling run comes first (no metadata, no cache yet): warm up there,
            # on a scratch cache of this layer's layout, so its memory is counted and no request
            # ever compiles a kernel of the sparse prefill path
            scratch = attn_metadata is None or kv_cache.numel() == 0
            self._warm_up_once(self._scratch_views(query) if scratch else self._views(kv_cache), query.dtype)
            self._warm = True
        if attn_metadata is None:  # profiling and dummy runs
            return output
        views = self._views(kv_cache)
        if meta_check.ENABLED and views.meta is not None and attn_metadata.has_prefill:  # debug only
            meta_check.check_requests(
                layer.layer_name, views.layout, kv_cache, views.meta, attn_metadata.block_table, attn_metadata.seq_lens
            )
        decode = attn_metadata.decode
        if decode is not None:
            self._forward_decode(query, views, decode, output, attn_metadata.dense_decode, attn_metadata.sparse_rows)
        if attn_metadata.has_prefill:
            n = attn_metadata.num_actual_tokens
            self._forward_planned(query[:n], views, attn_metadata, output[:n])
        return output

    _warmed: set = set()  # (method, layout, dtype) warmed in this process

    def _scratch_views(self, query: torch.Tensor) -> CacheViews:
        """Views of a small zeroed cache in this layer's layout (the warm-up reads pages only)."""
        from vllm_sparse.warmup import SCRATCH_BLOCKS

        n = self.block_size
        planes = MetaPlanes.for_method(self.method, self.num_kv_heads, n, self.head_size, query.dtype)
        slots = self.num_kv_heads + (planes.num_slots if planes else 0)
        cache = torch.zeros(SCRATCH_BLOCKS, slots, n, 2 * self.head_size, dtype=query.dtype, device=query.device)
        layout = PageLayout.of(cache, self.num_kv_heads, self.kv_order)
        return CacheViews(
            None, layout, layout.page_keys(cache), layout.page_values(cache), layout.keys(cache),
            layout.values(cache), planes.views(cache) if planes else None,
        )  # fmt: skip

    def _warm_up_once(self, views: CacheViews, dtype: torch.dtype) -> None:
        """Compile the sparse prefill path's kernels now (vLLM's start-up warm-up step), once per
        process and layer shape, instead of in the first long request (``vllm_sparse.warmup``)."""
        key = (self.method, views.layout, dtype, self.num_heads)
        if key in SparseAttentionImpl._warmed:
            return
        SparseAttentionImpl._warmed.add(key)
        from vllm_sparse.warmup import warm_up_prefill

        warm_up_prefill(
            self.selector, self.execute, self.policy, views.layout, views.page_keys, views.page_values, views.meta,
            self.num_heads, self.scale, dtype, -(-self.max_model_len // self.block_size),
        )  # fmt: skip

    def _forward_decode(
        self, query: torch.Tensor, views: CacheViews, decode: DecodeStep, output: torch.Tensor, dense_decode=None,
        sparse_rows=None,
    ):  # fmt: skip
        """The decode block (requests and query rows ``[0, B)``), device-driven: the same launches
        for any lengths (a CUDA graph per batch size replays them), no host sync, no host loop.
        ``dense_decode``: the step's FlashAttention plan (``backend.dense_decode``), which layers whose
        policy decodes every row dense run instead of the Triton kernel; ``sparse_rows``: per selecting
        policy, the FlashAttention plan its rows take after their selection (``backend.sparse_decode_rows``)."""
        from vllm_sparse.kernels.decode_attention import decode_attention_triton

        b, layout = decode.num_reqs, views.layout
        rows = b * layout.num_kv_heads
        observe = getattr(self.selector, "observe_decode", None)
        if observe is not None:  # every layer, dense or sparse (Kascade: anchor layers score)
            observe(query, views.page_keys, layout, decode)
        if dense_decode is not None and self.policy.decodes_dense:  # FLASH_ATTN's own decode call
            run_dense_decode(dense_decode, query[:b], views.keys, views.values, decode.block_table, self.scale,
                             output[:b])  # fmt: skip
            return
        if decode.selects(self.policy):
            pages, counts = self.selector.select_decode(query, views.page_keys, layout, views.meta, decode, self.policy)
            rows_plan = sparse_rows.get(self.policy) if sparse_rows else None
            if rows_plan is not None:  # FLASH_ATTN's decode kernel over the selected pages
                run_sparse_rows(rows_plan, query[:b], views.page_keys, views.page_values, decode.block_table, pages,
                                counts, decode.columns[self.policy], layout.num_head_slots, self.scale, output[:b])  # fmt: skip
                return
        elif decode.no_counts is not None and decode.no_counts.shape[0] == rows:
            pages, counts = decode.no_pages, decode.no_counts  # dense: every row attends all its pages
        else:
            pages = torch.zeros(rows, 1, dtype=torch.int32, device=query.device)
            counts = torch.zeros(rows, dtype=torch.int32, device=query.device)
        decode_attention_triton(
            query[:b], views.page_keys, views.page_values, decode.block_table, pages, counts,
            decode.columns[self.policy], layout.num_head_slots, self.scale, output[:b],
        )  # fmt: skip

    def _forward_planned(
        self, query: torch.Tensor, views: CacheViews, attn_metadata: SparseAttentionMetadata, out: torch.Tensor
    ) -> None:
        """Requests planned on the host per step (prefill chunks; every request on CPUs)."""
        layout, page_keys, page_values = views.layout, views.page_keys, views.page_values
        block_table = attn_metadata.block_table
        plan = attn_metadata.plan_for(self.policy)  # 1 policy
        state = plan.state.on(block_table, layout)  # what the layers of the step share
        observe = getattr(self.selector, "observe", None)
        if observe is not None:  # every step, dense or sparse (Kascade: anchor layers score)
            observe(query, page_keys, block_table, layout, plan)
        tables = None
        if not plan.any_sparse and self.dense_prefill is not None and attn_metadata.dense_rows is not None:
            self.dense_prefill(query, views.keys, views.values, attn_metadata.dense_rows, self.scale, out)
        elif not plan.any_sparse and hasattr(self.execute, "dense"):  # CPU_ATTN's own call, no page rows
            self.execute.dense(query, views.keys, views.values, block_table, plan, self.scale, out)
        else:
            if plan.any_sparse:  # 2 select
                selection = self.selector(query, page_keys, block_table, layout, plan, views.meta)
                if selection.unions is not None and stats.enabled():  # block-union selectors' stages
                    stats.record_unions(self.layer_idx, selection.unions)
            else:
                selection = state.no_selection
            tables = build_page_tables(plan, selection, block_table, layout)  # 3 tables
            self.execute(query, page_keys, page_values, tables, plan, self.scale, out)  # 4 execute

        counts = state.planned_pages
        # The host-known plan (an upper bound for variable budgets), so that counting never syncs
        # with a GPU; on CPU, when the counters are written, exact counts from the tables' rows (a
        # threshold or top-p attends fewer pages than planned).
        attended, prefill_attended = counts.attended, counts.prefill_attended
        if not query.is_cuda and stats.enabled() and tables is not None:
            attended = tables.attended_pages
            prefill_attended = tables.attended_pages_of([r.query_len > 1 for r in plan.requests])
        stats.record(counts.sparse_rows, attended, counts.dense, prefill_attended, counts.prefill_dense)
        if self.layer_idx == self.last_layer:
            stats.flush()


class SparseQuokaImpl(SparseAttentionImpl):
    method = "quoka"


class SparseQuestImpl(SparseAttentionImpl):
    method = "quest"


class SparseTwilightImpl(SparseAttentionImpl):
    method = "twilight"


class SparseKascadeImpl(SparseAttentionImpl):
    method = "kascade"


class SparseCompactImpl(SparseAttentionImpl):
    method = "compact"
