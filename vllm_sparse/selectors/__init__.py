"""Stage 2: one selector per method; ``make_selector`` picks it from the config."""

from __future__ import annotations

from vllm_sparse.config import SparseConfig
from vllm_sparse.selectors.base import Selection, Selector
from vllm_sparse.selectors.quest import QuestSelector
from vllm_sparse.selectors.quoka import QuokaSelector
from vllm_sparse.selectors.twilight import TwilightSelector

IMPLEMENTED_METHODS = ("quoka", "quest", "twilight")


def make_selector(config: SparseConfig, scale: float | None = None) -> Selector:
    """The selector of ``config.method``; ``scale`` is the layer's softmax scale (default 1/sqrt(D))."""
    window = config.query_window()
    if config.method == "quoka":
        return QuokaSelector(config.quoka.num_queries, query_window=window)
    if config.method == "quest":
        return QuestSelector(config.quest.gqa_reduce, scale, query_window=window)
    if config.method == "twilight":
        tw = config.twilight
        if tw.candidates == "quest":
            base: Selector = QuestSelector(config.quest.gqa_reduce, scale, query_window=window)
        else:
            base = QuokaSelector(config.quoka.num_queries, query_window=window)
        return TwilightSelector(base, tw.top_p, scale, query_window=window)
    raise NotImplementedError(
        f"sparse_{config.method} is not implemented yet; implemented: "
        + ", ".join(f"sparse_{m}" for m in IMPLEMENTED_METHODS)
    )


__all__ = [
    "IMPLEMENTED_METHODS",
    "QuestSelector",
    "QuokaSelector",
    "Selection",
    "Selector",
    "TwilightSelector",
    "make_selector",
]
