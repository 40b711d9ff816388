"""INT8 codes of the page key min/max planes, rounded outward: per (page, KV head) one scale
``s = max(|kmin|, |kmax|) / 127`` over the head's channels, ``kmin ~ floor(kmin / s) * s`` and
``kmax ~ ceil(kmax / s) * s``, so the decoded planes still bound every key of the page and Quest's
bounds stay upper bounds. Half the bytes of bf16 planes (plus 4 per scale), which is what a decode
step's Quest selection reads under ``quest.decode_planes: int8``.

The layout stores them beside the planes they code (``layout.PageMeta.kmin8/kmax8/mscale``), encoded
from the stored planes by every min/max write (``metadata.page_minmax``, whose Triton kernels do the
same arithmetic in float64). The Triton bounds read the codes in place
(``kernels.quest_rows.QuestRows.scale``); their torch twin is ``selectors.quest.page_upper_bounds``
over ``decode_minmax_int8``'s planes. On Qwen2.5-Coder-0.5B at 8K, Quest's decode pages from these
planes cover 0.0003 less dense attention mass than from bf16 planes
(``benchmarks/minmax_precision_cpu.py``, session 28).
"""

from __future__ import annotations

import torch

CODE_MAX = 127


def encode_minmax_int8(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kmin_codes int8, kmax_codes int8, scale float32)`` of planes ``[..., D]``: codes ``[..., D]``,
    scale ``[...]``, with ``codes * scale`` below ``kmin`` and above ``kmax`` (computed in float64;
    all-zero vectors get scale 1 and zero codes)."""
    lo, hi = kmin.double(), kmax.double()
    absmax = torch.maximum(lo.abs().amax(dim=-1), hi.abs().amax(dim=-1))
    scale = torch.where(absmax > 0, absmax / CODE_MAX, torch.ones_like(absmax)).float()
    short = scale.double() * CODE_MAX < absmax  # (a float32 scale rounded down: one step up keeps |x / s| <= 127)
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    s = scale.double()[..., None]
    lo_c = torch.floor(lo / s).clamp(-CODE_MAX, CODE_MAX)
    hi_c = torch.ceil(hi / s).clamp(-CODE_MAX, CODE_MAX)
    return lo_c.to(torch.int8), hi_c.to(torch.int8), scale


def decode_minmax_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``float32 [..., D]``: the plane that ``codes [..., D]`` with ``scale [...]`` stand for."""
    return codes.float() * scale[..., None]
