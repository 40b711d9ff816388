"""Stage 2: one selector per method; ``make_selector`` picks it from the config."""

from __future__ import annotations

from vllm_sparse.config import SparseConfig
from vllm_sparse.selectors.base import Selection, Selector
from vllm_sparse.selectors.compact import CompactSelector
from vllm_sparse.selectors.kascade import KascadeSelector
from vllm_sparse.selectors.quest import QuestSelector
from vllm_sparse.selectors.quoka import QuokaSelector
from vllm_sparse.selectors.twilight import TwilightSelector

IMPLEMENTED_METHODS = ("quoka", "quest", "twilight", "kascade", "compact")
#: methods whose decodes run the device decode path (``Selector.select_decode``, full CUDA graphs on
#: GPUs; compact's always dense there); a method not listed decodes through the host-planned path (eager)
DEVICE_DECODE_METHODS = ("quoka", "quest", "twilight", "compact", "kascade")


def make_selector(config: SparseConfig, scale: float | None = None) -> Selector:
    """The selector of ``config.method``; ``scale`` is the layer's softmax scale (default 1/sqrt(D)).
    A selector with ``for_layer(layer, num_layers, kv_heads)`` (Kascade) is bound to its layer before use."""
    window = config.query_window()
    if config.method == "quoka":
        return QuokaSelector(config.quoka.num_queries, query_window=window)
    if config.method == "quest":
        return _quest(config, scale, window)
    if config.method == "twilight":
        tw = config.twilight
        if tw.candidates == "quest":
            base: Selector = _quest(config, scale, window)
        else:
            base = QuokaSelector(config.quoka.num_queries, query_window=window)
        return TwilightSelector(base, tw.top_p, scale, query_window=window, prune_prefill=tw.prune_prefill)
    if config.method == "kascade":
        return KascadeSelector(config, scale)
    if config.method == "compact":
        return CompactSelector(config.compact, scale, query_window=window)
    raise NotImplementedError(
        f"sparse_{config.method} is not implemented yet; implemented: "
        + ", ".join(f"sparse_{m}" for m in IMPLEMENTED_METHODS)
    )


def _quest(config: SparseConfig, scale: float | None, window: int | None) -> QuestSelector:
    """Quest (or Twilight's Quest candidates): bounds, and QuoKA's exact scores for prefill chunks
    under ``quest.prefill_scores: exact`` (every query of a chunk unless ``chunk_query_window`` is set)."""
    exact = None
    if config.quest_prefill_scores() == "exact":
        exact = QuokaSelector(config.quoka.num_queries, query_window=config.chunk_query_window or None)
    return QuestSelector(
        config.quest.gqa_reduce, scale, query_window=window, prefill=exact,
        decode_int8=config.quest.decode_planes == "int8",
    )  # fmt: skip


__all__ = [
    "CompactSelector",
    "DEVICE_DECODE_METHODS",
    "IMPLEMENTED_METHODS",
    "KascadeSelector",
    "QuestSelector",
    "QuokaSelector",
    "Selection",
    "Selector",
    "TwilightSelector",
    "make_selector",
]
