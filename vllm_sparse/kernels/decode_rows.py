"""What the decode scoring kernels share: each program's part of its row's selectable pages.

Row ``r = request * Hkv + head`` selects among pages ``[HEAD, TAIL)`` of its request
(``policy.decode_columns``); a row asked to select nothing (dense or CUDA-graph padding) scores
nothing. The grid is ``(rows, programs_per_row)``, fixed for a batch size; the split of a row's
pages over its programs is computed on the device.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_sparse.kernels.paged_attention import num_sms


@triton.jit
def selectable_share(cols_ptr, req, NCOLS: tl.constexpr, C_SELECT: tl.constexpr, C_HEAD: tl.constexpr,
                     C_TAIL: tl.constexpr, BLOCK_P: tl.constexpr):  # fmt: skip
    """``(start, end)``: this program's pages of the row's ``[HEAD, TAIL)``, in whole tiles of
    ``BLOCK_P`` (empty when the row selects nothing)."""
    cb = cols_ptr + req * NCOLS
    lo = tl.load(cb + C_HEAD)
    hi = tl.load(cb + C_TAIL)
    share = tl.cdiv(tl.cdiv(hi - lo, tl.num_programs(1)), BLOCK_P) * BLOCK_P
    start = lo + tl.program_id(1) * share
    end = tl.minimum(hi, start + share)
    if tl.load(cb + C_SELECT) == 0:
        end = start
    return start, end


def programs_per_row(rows: int, page_cap: int, block_p: int, device) -> int:
    """Programs per row so that about four run per SM, at most one per tile of pages."""
    return max(1, min(triton.cdiv(page_cap, block_p), triton.cdiv(4 * num_sms(device), max(rows, 1))))
