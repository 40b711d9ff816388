"""Kascade calibration (vllm_sparse/calibration/): the anchor dynamic program against brute force on
small layer counts, the recovery matrix on hand-made attention, and the YAML it writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from vllm_sparse.calibration.anchors import brute_force_anchors, objective, select_anchors
from vllm_sparse.calibration.run import write_config
from vllm_sparse.calibration.similarity import layer_similarity, prompt_head_similarity
from vllm_sparse.config import SparseConfig


@pytest.mark.parametrize("layers", [1, 2, 3, 5, 7, 9])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp_matches_brute_force(layers, m, seed):
    rng = np.random.default_rng(seed * 100 + layers * 10 + m)
    s = np.triu(rng.uniform(0.0, 1.0, (layers, layers)))
    got = select_anchors(s, m)
    want, best = brute_force_anchors(s, m)
    assert got[0] == 0 and got == sorted(set(got)) and len(got) == min(m, layers)
    assert objective(s, got) == pytest.approx(best), (got, want)


def test_dp_prefers_anchors_where_similarity_breaks():
    """Two blocks of mutually similar layers: the second anchor starts the second block."""
    s = np.full((6, 6), 0.1)
    s[:3, :3] = s[3:, 3:] = 1.0
    assert select_anchors(np.triu(s), 2) == [0, 3]


def _causal(t: int, hot: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` causal rows putting most mass on key ``hot[q]``."""
    logits = torch.full((t, t), 0.0)
    logits[torch.arange(t), hot] = 8.0
    logits = logits.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    return torch.softmax(logits, -1)


def test_recovery_and_head_map_follow_swapped_heads():
    """Layer 1's head 0 attends like layer 0's head 1 and vice versa: the head map swaps them and
    the recovery of the mapped heads is full."""
    t, g = 48, torch.Generator().manual_seed(0)
    hot = [torch.randint(0, 1, (t,)) + (torch.arange(t) * torch.rand(t, generator=g)).long() for _ in range(2)]
    l0 = torch.stack([_causal(t, hot[0]), _causal(t, hot[1])])
    l1 = l0.flip(0)
    sim = prompt_head_similarity([l0, l1], k=4, min_query=8)
    s, maps = layer_similarity(sim, torch.tensor([1.0, 0.5]))
    assert maps[0, 1].tolist() == [1, 0]
    assert s[0, 1].item() == pytest.approx(0.5, abs=1e-4)  # full recovery, weighted by w_1
    assert s[0, 0].item() == pytest.approx(1.0, abs=1e-4)


def test_write_config_replaces_the_kascade_block(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("# header\nbudget: {fraction: 0.25}\nkascade:\n  anchors: [0, 1]\nsink_tokens: 16\n")
    block = "# kascade: calibrated\n# layer-weighted, ...\nkascade:\n  anchors: [0, 2]\n  head_map: {1: [1, 0]}\n"
    write_config(path, block)
    write_config(path, block)  # idempotent
    text = path.read_text()
    assert text.count("kascade:\n") == 1 and text.startswith("# header")
    cfg = SparseConfig(**{**yaml.safe_load(text), "method": "kascade"})
    assert cfg.kascade.anchors == [0, 2] and cfg.kascade.head_map == {1: [1, 0]} and cfg.sink_tokens == 16
