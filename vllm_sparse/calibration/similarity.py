"""Kascade's layer-to-layer recovery matrix from the pooled attention of a dense run (paper Sec. 3.3-3.5).

For one prompt, ``P[l] [Hkv, T, T]`` is layer ``l``'s post-softmax attention pooled over the G query
heads of each KV head (the runtime's decode pooling). With ``I[l, h, q] = topk(P[l, h, q], k)``,
the fraction of layer ``b`` head ``h``'s own top-k mass recovered with anchor ``a`` head ``h'``'s
indices is ``sim_q = sum P[b,h,q][I[a,h',q]] / sum P[b,h,q][I[b,h,q]]``; per prompt the minimum over
queries (the paper's conservative rule), then the mean over prompts. Head maps take, per reuse head,
the best anchor head; the layer matrix is the mean over reuse heads of that best, weighted per
column by the layer's importance ``w_b = mean(1 - cos(x_b, y_b))`` (attention input vs output).
"""

from __future__ import annotations

import torch


def prompt_head_similarity(pooled: list[torch.Tensor], k: int = 64, min_query: int | None = None) -> torch.Tensor:
    """One prompt's head-level recovery, min over queries.

    Args:
        pooled: per layer ``[Hkv, T, T]`` pooled causal attention (rows sum to 1).
        k: tokens per top-k set (paper: 64).
        min_query: first query position scored (default ``2 * k``: earlier rows keep nearly all keys).
    Returns:
        ``float32 [L, L, Hkv, Hkv]``, ``[a, b, h', h]`` for ``a <= b`` (``1`` on ``a == b, h' == h``;
        ``a > b`` entries are 0).
    """
    n_layers = len(pooled)
    hkv, t, _ = pooled[0].shape
    q0 = min(t - 1, 2 * k if min_query is None else min_query)
    idx = [p[:, q0:].float().topk(k, dim=-1).indices for p in pooled]  # [Hkv, T', k]
    out = torch.zeros(n_layers, n_layers, hkv, hkv)
    for b in range(n_layers):
        pb = pooled[b][:, q0:].float()  # [Hkv, T', T]
        own = pb.gather(-1, idx[b]).sum(-1)  # [Hkv, T']
        for a in range(b + 1):
            for ha in range(hkv):
                got = pb.gather(-1, idx[a][ha].expand(hkv, -1, -1)).sum(-1)  # [Hkv(h), T']
                out[a, b, ha] = (got / own.clamp_min(1e-12)).amin(dim=-1)
    return out


def layer_similarity(head_sim: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted layer matrix and the head maps from the mean head similarity over prompts.

    Args:
        head_sim: ``[L, L, Hkv, Hkv]`` mean over prompts of ``prompt_head_similarity``.
        weights: ``[L]`` layer importance.
    Returns:
        ``(S [L, L], head_map int64 [L, L, Hkv])``: ``S[a, b] = w_b * mean_h max_h' head_sim[a, b, h', h]``
        and ``head_map[a, b, h] = argmax_h' head_sim[a, b, h', h]``.
    """
    best, arg = head_sim.max(dim=2)  # over anchor heads h': [L, L, Hkv]
    return best.mean(-1) * weights[None, :], arg
