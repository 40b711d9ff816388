"""Kascade's anchor selection (the paper's Algorithm 1): a dynamic program over the similarity matrix.

Anchors ``a_0 = 0 < a_1 < ... < a_{M-1}`` split the ``L`` layers into segments; anchor ``a_i`` serves
the layers ``a_i .. a_{i+1} - 1`` (the last one up to ``L - 1``). The objective is the total
similarity of every layer to the anchor serving it, ``sum_i sum_{l in segment i} S[a_i, l]``.
"""

from __future__ import annotations

import itertools

import numpy as np


def _segment_sums(s: np.ndarray) -> np.ndarray:
    """``cum[i, j] = sum_{l=i}^{j-1} S[i, l]`` for ``j > i`` (``[L, L + 1]``)."""
    n = s.shape[0]
    cum = np.zeros((n, n + 1))
    for i in range(n):
        cum[i, i + 1 :] = np.cumsum(s[i, i:])
    return cum


def select_anchors(s: np.ndarray, num_anchors: int) -> list[int]:
    """The ``num_anchors`` anchors (layer 0 first) that maximise the objective above.

    Args:
        s: ``[L, L]`` weighted similarity, ``s[a, l]`` how well anchor ``a`` serves layer ``l >= a``.
    Returns:
        ascending layer indices, ``min(num_anchors, L)`` of them.
    """
    n = s.shape[0]
    m_max = min(num_anchors, n)
    cum = _segment_sums(s)
    # f[m, j]: best total over layers [0, j) with m anchors, the next segment starting at j
    f = np.full((m_max + 1, n + 1), -np.inf)
    arg = np.zeros((m_max + 1, n + 1), dtype=np.int64)
    f[1, 1:] = cum[0, 1:]
    for m in range(2, m_max + 1):
        for j in range(m, n + 1):
            cand = [f[m - 1, i] + cum[i, j] for i in range(m - 1, j)]
            best = int(np.argmax(cand))
            f[m, j], arg[m, j] = cand[best], best + m - 1
    anchors, j = [], n
    for m in range(m_max, 1, -1):
        j = int(arg[m, j])
        anchors.append(j)
    return [0, *sorted(anchors)]


def objective(s: np.ndarray, anchors: list[int]) -> float:
    """The total similarity of every layer to the anchor serving it."""
    n = s.shape[0]
    bounds = [*anchors, n]
    return float(sum(s[a, a:b].sum() for a, b in zip(bounds, bounds[1:])))


def brute_force_anchors(s: np.ndarray, num_anchors: int) -> tuple[list[int], float]:
    """The best anchors by enumeration (the test oracle of ``select_anchors``; small ``L`` only)."""
    n = s.shape[0]
    best = max(
        ([0, *rest] for rest in itertools.combinations(range(1, n), min(num_anchors, n) - 1)),
        key=lambda a: objective(s, a),
    )
    return best, objective(s, best)
