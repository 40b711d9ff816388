"""Triton paged attention over ragged per-(request, KV head) page rows; twin:
``vllm_sparse.executors.reference.reference_executor``.

Each row (``row = request * Hkv + head``) attends its compacted pages, ``tables.kv_lens[row]``
tokens read on the device, so rows of different lengths (Twilight's top-p rows) need no padding
and no host sync. The causal mask is bottom-right aligned over the compacted tokens (see
``tables``): query ``i`` of a chunk of ``C`` sees compacted token ``j`` when ``j <= kv_len - C + i``.

Work items (host-planned once per step from the plan's query lengths, kept on the step's ``StepState``):
one per (row, query block), a query block being ``BLOCK_M`` rows of (token, query head of the
row's GQA group) pairs, so the G heads sharing a KV head share every K/V tile. Each program runs
an online softmax (base 2) over ``BLOCK_N`` tokens at a time, K and V gathered in place through
the row's physical page ids.

Split-KV: when the items are too few to fill the GPU (decode at small batch), every item's
tokens are split over ``splits`` programs that write normalised partial outputs and their
log-sum-exp; a second kernel merges them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_sparse.kernels.split_merge import merge_partials

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["split_tokens", "stride_pr"])
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    page_ids_ptr,
    kv_lens_ptr,
    item_row_ptr,
    item_qblock_ptr,
    req_qstart_ptr,
    req_qlen_ptr,
    part_o_ptr,
    part_lse_ptr,
    scale_log2,
    split_tokens,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kd,
    stride_vp,
    stride_vt,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_pr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
):
    item = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.load(item_row_ptr + item)
    qb = tl.load(item_qblock_ptr + item)
    req = row // HKV
    kv = row % HKV
    q_start = tl.load(req_qstart_ptr + req).to(tl.int64)
    q_len = tl.load(req_qlen_ptr + req)
    kv_len = tl.load(kv_lens_ptr + row)

    TOKS: tl.constexpr = BLOCK_M // G_PAD
    m = tl.arange(0, BLOCK_M)
    tok = qb * TOKS + m // G_PAD
    g = m % G_PAD
    valid_m = (tok < q_len) & (g < G)
    head = kv * G + g
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=valid_m[:, None] & dm[None, :],
        other=0.0,
    )
    if LOW_PRECISION:
        q = q.to(k_ptr.dtype.element_ty)
    else:
        q = q.to(tl.float32)
    limit = kv_len - q_len + tok  # last visible compacted token of each query row
    last_tok = tl.minimum(qb * TOKS + TOKS, q_len) - 1
    hi = tl.minimum(kv_len, kv_len - q_len + last_tok + 1)
    lo = 0
    if SPLIT:
        lo = split * split_tokens
        hi = tl.minimum(hi, lo + split_tokens)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pid_row = page_ids_ptr + row.to(tl.int64) * stride_pr
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tm = t < hi
        page = tl.load(pid_row + t // PAGE, mask=tm, other=0)
        off = t % PAGE
        kvm = tm[:, None] & dm[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + off[:, None] * stride_kt + d[None, :] * stride_kd, mask=kvm, other=0.0)
        v = tl.load(v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vt + d[None, :] * stride_vd, mask=kvm, other=0.0)
        if not LOW_PRECISION:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where((t[None, :] <= limit[:, None]) & tm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None]
    if SPLIT:
        nsplit = tl.num_programs(1)
        base = (item * nsplit + split) * BLOCK_M + m
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + base, lse)
        tl.store(part_o_ptr + base[:, None] * BLOCK_D + d[None, :], o)
    else:
        tl.store(
            out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=valid_m[:, None] & dm[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    out_ptr,
    item_row_ptr,
    item_qblock_ptr,
    req_qstart_ptr,
    req_qlen_ptr,
    part_o_ptr,
    part_lse_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HKV: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    item = tl.program_id(0)
    row = tl.load(item_row_ptr + item)
    qb = tl.load(item_qblock_ptr + item)
    req = row // HKV
    kv = row % HKV
    q_start = tl.load(req_qstart_ptr + req).to(tl.int64)
    q_len = tl.load(req_qlen_ptr + req)
    TOKS: tl.constexpr = BLOCK_M // G_PAD
    m = tl.arange(0, BLOCK_M)
    tok = qb * TOKS + m // G_PAD
    g = m % G_PAD
    valid_m = (tok < q_len) & (g < G)
    d = tl.arange(0, BLOCK_D)
    o = merge_partials(part_o_ptr, part_lse_ptr, item, num_splits, BLOCK_M, BLOCK_D)
    tl.store(
        out_ptr + (q_start + tok)[:, None] * stride_ot + (kv * G + g)[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=valid_m[:, None] & (d < D)[None, :],
    )


class WorkPlan:
    """Host-planned launch geometry of one step (device tensors built once, shared by layers)."""

    def __init__(self, query_starts, query_lens, max_tokens, hkv, g, device, block_m, block_n, num_sms):
        g_pad = triton.next_power_of_2(g)
        block_m = max(block_m, g_pad)
        toks = block_m // g_pad
        rows, qblocks = [], []
        for r, ql in enumerate(query_lens):
            nqb = -(-ql // toks)
            for h in range(hkv):
                rows += [r * hkv + h] * nqb
                qblocks += range(nqb)
        self.num_items = len(rows)
        self.block_m, self.g_pad = block_m, g_pad
        # split the tokens when the items alone leave most of the GPU idle
        splits = 1
        if self.num_items and self.num_items < num_sms:
            splits = max(1, min(-(-2 * num_sms // self.num_items), max_tokens // (4 * block_n)))
        cdiv = lambda a, b: -(-a // b)  # noqa: E731
        self.split_tokens = cdiv(cdiv(max_tokens, splits), block_n) * block_n if splits > 1 else 0
        self.splits = -(-max_tokens // self.split_tokens) if splits > 1 else 1
        host = torch.tensor([rows, qblocks], dtype=torch.int32)
        reqs = torch.tensor([list(query_starts), list(query_lens)], dtype=torch.int32)
        dev = torch.cat([host.flatten(), reqs.flatten()]).to(device, non_blocking=True)
        w, b = self.num_items, len(query_lens)
        self.item_row, self.item_qblock = dev[:w], dev[w : 2 * w]
        self.req_qstart, self.req_qlen = dev[2 * w : 2 * w + b], dev[2 * w + b :]


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: exercise the split path at small shapes


def paged_attention_triton(
    query: torch.Tensor,
    page_keys: torch.Tensor,
    page_values: torch.Tensor,
    page_ids: torch.Tensor,
    kv_lens: torch.Tensor,
    work: WorkPlan,
    num_kv_heads: int,
    scale: float,
    output: torch.Tensor,
    block_n: int,
) -> None:
    """Attend every query to its row's pages (see the module doc); ``output`` written in place.

    Args:
        query, output: ``[T, Hq, D]`` (last dim contiguous).
        page_keys, page_values: ``[num_pages, N, D]`` by physical page id (strided views).
        page_ids: ``int64 [rows, width]``; kv_lens: ``int32 [rows]`` (device).
        work: the step's ``WorkPlan`` (same ``block_n``).
    """
    if work.num_items == 0:
        return
    _, hq, d = query.shape
    g = hq // num_kv_heads
    n = page_keys.shape[1]
    assert query.stride(-1) == 1 and output.stride(-1) == 1 and page_ids.stride(-1) == 1
    low = query.is_cuda and page_keys.dtype in (torch.bfloat16, torch.float16)
    block_d = max(16, triton.next_power_of_2(d))
    split = work.splits > 1
    if split:
        part_lse = torch.empty(work.num_items * work.splits * work.block_m, dtype=torch.float32, device=query.device)
        part_o = torch.empty(part_lse.numel(), block_d, dtype=torch.float32, device=query.device)
    else:
        part_lse = part_o = output
    consts = dict(HKV=num_kv_heads, G=g, G_PAD=work.g_pad, D=d, BLOCK_D=block_d, BLOCK_M=work.block_m)
    _attn_kernel[(work.num_items, work.splits)](
        query, page_keys, page_values, output, page_ids, kv_lens,
        work.item_row, work.item_qblock, work.req_qstart, work.req_qlen, part_o, part_lse,
        scale * LOG2E, work.split_tokens,
        query.stride(0), query.stride(1),
        page_keys.stride(0), page_keys.stride(1), page_keys.stride(2),
        page_values.stride(0), page_values.stride(1), page_values.stride(2),
        output.stride(0), output.stride(1), page_ids.stride(0),
        PAGE=n, BLOCK_N=block_n, SPLIT=split, LOW_PRECISION=low,
        num_warps=4, **consts,
    )  # fmt: skip
    if split:
        _merge_kernel[(work.num_items,)](
            output, work.item_row, work.item_qblock, work.req_qstart, work.req_qlen, part_o, part_lse,
            work.splits, output.stride(0), output.stride(1), num_warps=4, **consts,
        )  # fmt: skip
