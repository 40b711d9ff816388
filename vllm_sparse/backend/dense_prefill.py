"""Dense prefill at dense's own cost: the step's prefill requests, every KV head at once, through
vLLM's FlashAttention (FA3 on Hopper) reading the head-major cache in place.

A prefill step whose requests all run dense (first chunks, contexts below the break-even, dense
layers, prefill the cost model sends dense) gains nothing from per-(request, KV head) page tables:
it is one paged, causal, varlen attention, exactly what the FLASH_ATTN backend runs. The cache
``[num_blocks, head_slots, N, 2D]`` viewed as ``[num_blocks, N, Hkv, D]`` (token stride ``2D``,
head stride ``N * 2D``) is a layout FlashAttention reads through its stride arguments, so nothing is
copied. ``dense_prefill_reference`` is the torch twin.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("vllm_sparse")


@dataclass(frozen=True)
class DenseRows:
    """The prefill requests of one step, as one dense attention call (built once per step).

    Attributes:
        token_start: first query row of the prefill requests in the step's ``query``.
        num_tokens: their query rows (``query[token_start : token_start + num_tokens]``).
        query_start: ``int32 [P + 1]`` query offsets relative to ``token_start`` (device).
        seq_lens: ``int32 [P]`` context + query tokens per request (device).
        block_table: ``int32 [P, max_blocks]`` the requests' block-table rows (device).
        max_query_len, max_seq_len: host maxima of the two.
    """

    token_start: int
    num_tokens: int
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int


def cache_kv_nhd(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_blocks, Hkv, N, D]`` strided K/V views -> ``[num_blocks, N, Hkv, D]`` views (no copy)."""
    return keys.transpose(1, 2), values.transpose(1, 2)


def flash_attn_version(head_size: int, page_size: int) -> int | None:
    """The FlashAttention version vLLM runs for these shapes on this GPU, with paged KV and varlen
    queries (3 on Hopper); None where vLLM ships none (the per-row executors run then)."""
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version, is_flash_attn_varlen_func_available

        if not is_flash_attn_varlen_func_available():
            return None
        return get_flash_attn_version(head_size=head_size, kv_cache_block_size=page_size)
    except Exception as e:  # noqa: BLE001  (no FlashAttention build for this platform)
        logger.info("vllm-sparse: no FlashAttention for head size %d, pages of %d (%s)", head_size, page_size, e)
        return None


class DensePrefill:
    """vLLM's FlashAttention varlen kernel over the block table; ``None`` from ``create`` where
    vLLM ships no FlashAttention for this GPU (the per-row sparse path then runs dense rows)."""

    def __init__(self, fa_version: int):
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func
        self.fa_version = fa_version

    @classmethod
    def create(cls, head_size: int, page_size: int) -> DensePrefill | None:
        version = flash_attn_version(head_size, page_size)
        return None if version is None else cls(version)

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: DenseRows,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """query/output ``[T, Hq, D]`` (the whole step); keys/values ``[num_blocks, Hkv, N, D]``
        strided views of the cache. Writes ``output[token_start : token_start + num_tokens]``."""
        lo, hi = rows.token_start, rows.token_start + rows.num_tokens
        k, v = cache_kv_nhd(keys, values)
        self._fn(
            q=query[lo:hi],
            k=k,
            v=v,
            out=output[lo:hi],
            cu_seqlens_q=rows.query_start,
            max_seqlen_q=rows.max_query_len,
            seqused_k=rows.seq_lens,
            max_seqlen_k=rows.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=rows.block_table,
            fa_version=self.fa_version,
        )


def dense_prefill_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: DenseRows, scale: float
) -> torch.Tensor:
    """Torch twin of ``DensePrefill``: float32 ``[num_tokens, Hq, D]``, causal bottom-right."""
    t0 = rows.token_start
    qs, sl, bt = rows.query_start.tolist(), rows.seq_lens.tolist(), rows.block_table.long()
    n = keys.shape[2]
    hq, hkv = query.shape[1], keys.shape[1]
    out = torch.zeros(rows.num_tokens, hq, query.shape[2], dtype=torch.float32, device=query.device)
    for i, seq in enumerate(sl):
        q = query[t0 + qs[i] : t0 + qs[i + 1]].float()  # [q, Hq, D]
        pos = torch.arange(seq, device=query.device)
        blocks = bt[i, pos // n]
        k = keys[blocks, :, pos % n].float().repeat_interleave(hq // hkv, dim=1)  # [seq, Hq, D]
        v = values[blocks, :, pos % n].float().repeat_interleave(hq // hkv, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q, k) * scale
        qpos = torch.arange(seq - q.shape[0], seq, device=query.device)
        logits = logits.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[qs[i] : qs[i + 1]] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v)
    return out
