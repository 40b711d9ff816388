"""Per-step metadata and its builder: host-side lengths, the step plans, and the executor's plan.

The builder runs once per scheduler step for all layers of a KV-cache group. From lengths the
scheduler knows on the host it computes the step plan of every layer policy in the group
(``policy.plan_step``) and, where the layers' executor plans per step (FlashInfer on GPUs), makes
that plan here, so a layer's forward only selects, writes its page ids and runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

from vllm_sparse.config import LayerPolicy
from vllm_sparse.policy import StepPlan, plan_step


@dataclass
class SparseAttentionMetadata:
    """One step of one KV-cache group; shared by all its layers.

    Attributes:
        num_actual_tokens: tokens in this step (``query`` may be padded past it).
        query_start_loc: host ``[B + 1]``.
        seq_lens: host ``[B]`` context + query tokens per request.
        block_table: ``int32 [B, max_blocks]`` logical page -> block, on the device.
        slot_mapping: ``int64 [T]`` on the device.
    """

    num_actual_tokens: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    page_size: int
    _plans: dict[LayerPolicy, StepPlan] = field(default_factory=dict, repr=False)

    def plan_for(self, policy: LayerPolicy) -> StepPlan:
        """The step plan of a layer policy, computed once per step and shared by its layers."""
        plan = self._plans.get(policy)
        if plan is None:
            plan = self._plans[policy] = plan_step(policy, self.page_size, self.query_start_loc, self.seq_lens)
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


class SparseMetadataBuilder(AttentionMetadataBuilder[SparseAttentionMetadata]):
    _cudagraph_support = AttentionCGSupport.NEVER  # attention runs eagerly between piecewise graphs

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.page_size = kv_cache_spec.block_size
        self._work = self._step_work(vllm_config, layer_names, kv_cache_spec)

    @staticmethod
    def _step_work(vllm_config, layer_names, kv_cache_spec) -> tuple[_StepWork, ...]:
        """The distinct (policy, executor, shapes) of the group's layers whose executor plans per step."""
        work = []
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
        q_dtype = vllm_config.model_config.dtype if vllm_config.model_config is not None else None
        for name, layer in layers.items():
            impl = getattr(layer, "impl", None)
            prepare = getattr(getattr(impl, "execute", None), "prepare", None)
            if prepare is None or not hasattr(impl, "config"):
                continue
            w = _StepWork(
                impl.config.for_layer(extract_layer_index(name)),
                impl.execute,
                impl.num_kv_heads,
                impl.num_heads // impl.num_kv_heads,
                impl.head_size,
                q_dtype,
                kv_cache_spec.dtype,
                impl.scale,
            )
            if w not in work:
                work.append(w)
        return tuple(work)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> SparseAttentionMetadata:
        cm = common_attn_metadata
        b = cm.num_reqs
        seq_cpu = cm.seq_lens_cpu_upper_bound
        if seq_cpu is None:
            seq_cpu = cm.seq_lens.cpu()
        meta = SparseAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=cm.query_start_loc_cpu[: b + 1].tolist(),
            seq_lens=seq_cpu[:b].tolist(),
            block_table=cm.block_table_tensor[:b],
            slot_mapping=cm.slot_mapping,
            page_size=self.page_size,
        )
        for w in self._work:  # plan once per step, here, for every layer of the group
            plan = meta.plan_for(w.policy)
            if plan.requests:
                w.executor.prepare(
                    plan, w.num_kv_heads, w.group, w.head_size, w.q_dtype, w.kv_dtype, w.scale, self.device
                )
        return meta
