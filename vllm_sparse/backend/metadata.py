"""Per-step metadata and its builder: host-side lengths, and the step plans derived from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
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


class SparseMetadataBuilder(AttentionMetadataBuilder[SparseAttentionMetadata]):
    _cudagraph_support = AttentionCGSupport.NEVER  # attention runs eagerly between piecewise graphs

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.page_size = kv_cache_spec.block_size

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> SparseAttentionMetadata:
        cm = common_attn_metadata
        b = cm.num_reqs
        seq_cpu = cm.seq_lens_cpu_upper_bound
        if seq_cpu is None:
            seq_cpu = cm.seq_lens.cpu()
        return SparseAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=cm.query_start_loc_cpu[: b + 1].tolist(),
            seq_lens=seq_cpu[:b].tolist(),
            block_table=cm.block_table_tensor[:b],
            slot_mapping=cm.slot_mapping,
            page_size=self.page_size,
        )
