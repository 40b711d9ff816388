"""Attention recall: the share of dense attention mass that a selector's pages cover.

For queries ``q`` of one step (a prefill chunk, or one decode token) dense causal softmax attention
over every visible key is computed exactly; its mass is summed per past page. A selector attends
forced pages (sink, local window), its selected pages and the step's own tokens (the chunk's pages,
including the part of the chunk's first page that holds past tokens). Its **recall** is the dense
mass on those tokens, per query head, averaged over the step's queries:

    recall[h] = mean_c ( rest[c, h] + sum_{p in forced + selected(kv(h))} mass[c, h, p] )

where ``rest`` is the mass on the tokens at or after the first chunk page. The **oracle** at the
same page count per KV head picks the past pages with the largest group mass (the sum over the G
query heads of the KV head): for a fixed number of pages shared by the group, that maximises the
group's mean recall, so no selector can cover more. ``selectable`` recall is the share of the mass
on the non-forced past pages that the selected ones cover (the selector's own part; 1 when the
selection is the whole past).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUERY_BLOCK = 128  # queries at a time (bounds the [Hq, block, S] weights)


@dataclass(frozen=True)
class PageMass:
    """Dense attention mass of a step's queries, mean over the queries.

    Attributes:
        past: ``float32 [Hkv, G, P]`` mass on each of the ``P`` past pages.
        rest: ``float32 [Hkv, G]`` mass on every later token (the step's own pages).
    """

    past: torch.Tensor
    rest: torch.Tensor


def dense_page_mass(q: torch.Tensor, keys: torch.Tensor, num_past: int, page_size: int, scale: float) -> PageMass:
    """Exact causal softmax mass of queries ``q [C, Hq, D]`` at positions ``S - C .. S - 1`` over
    ``keys [S, Hkv, D]``, summed per past page (``num_past`` pages of ``page_size``) and over the
    rest, averaged over the queries."""
    c, hq, d = q.shape
    s, hkv, _ = keys.shape
    g = hq // hkv
    kt = keys.float().permute(1, 2, 0)  # [Hkv, D, S]
    past = torch.zeros(hkv, g, num_past, dtype=torch.float32)
    rest = torch.zeros(hkv, g, dtype=torch.float32)
    cut = num_past * page_size
    for a in range(0, c, QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, c)
        qb = q[a:b].float().view(b - a, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * (b - a), d)
        logits = torch.bmm(qb, kt).view(hkv, g, b - a, s) * scale
        pos = torch.arange(s - c + a, s - c + b)[:, None]
        logits.masked_fill_(torch.arange(s)[None, :] > pos, float("-inf"))
        w = torch.softmax(logits, dim=-1)  # [Hkv, G, b - a, S]
        past += w[..., :cut].reshape(hkv, g, b - a, num_past, page_size).sum(dim=(2, 4))
        rest += w[..., cut:].sum(dim=(2, 3))
    return PageMass(past / c, rest / c)


def covered(mass: PageMass, forced: torch.Tensor, selected: list[torch.Tensor]) -> torch.Tensor:
    """``float32 [Hkv, G]`` recall of forced pages ``int64 [F]`` plus ``selected[h]`` ``int64 [k_h]``."""
    base = mass.rest + mass.past[:, :, forced].sum(dim=-1)
    return torch.stack([base[h] + mass.past[h][:, sel].sum(dim=-1) for h, sel in enumerate(selected)])


def selectable_share(mass: PageMass, forced: torch.Tensor, recall: torch.Tensor) -> torch.Tensor:
    """``float32 [Hkv, G]``: the share of the mass on non-forced past pages that ``recall [Hkv, G]``
    covers beyond the forced pages and the rest (1 where there is no such mass)."""
    free = mass.past.sum(dim=-1) - mass.past[:, :, forced].sum(dim=-1)
    got = recall - mass.rest - mass.past[:, :, forced].sum(dim=-1)
    return torch.where(free > 0, got / free.clamp_min(1e-30), torch.ones_like(free)).clamp(0.0, 1.0)


def oracle_pages(mass: PageMass, forced: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Per KV head the ``counts[h]`` non-forced past pages of largest group mass (``int64 [k_h]``)."""
    group = mass.past.sum(dim=1).index_fill(1, forced, float("-inf"))  # [Hkv, P]
    return [torch.topk(group[h], k).indices for h, k in enumerate(counts)]


def needle_coverage(pages: torch.Tensor, forced: torch.Tensor, selected: list[torch.Tensor],
                    num_past: int) -> list[float] | None:  # fmt: skip
    """Per KV head the share of the needle's past pages (``pages int64 [n]``, logical; those at or
    past ``num_past`` are the step's own and always attended) that are forced or selected; None
    when no needle page is a past page."""
    past = pages[pages < num_past]
    if past.numel() == 0:
        return None
    return [float(torch.isin(past, torch.cat([forced, sel])).float().mean()) for sel in selected]


def needle_mass(mass: PageMass, pages: torch.Tensor, forced: torch.Tensor,
                selected: list[torch.Tensor]) -> tuple[list[float], list[float]]:  # fmt: skip
    """Per KV head (mean over its query heads) the dense mass on the needle's past pages
    (``pages int64 [n]``), and the part of it on forced or selected pages."""
    num_past = mass.past.shape[-1]
    past = pages[pages < num_past]
    total, got = [], []
    for h, sel in enumerate(selected):
        on = mass.past[h][:, past]  # [G, n]
        hit = torch.isin(past, torch.cat([forced, sel]))
        total.append(float(on.sum(dim=-1).mean()))
        got.append(float(on[:, hit].sum(dim=-1).mean()))
    return total, got
