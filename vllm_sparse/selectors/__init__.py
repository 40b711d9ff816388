"""Stage 2: one selector per method; ``make_selector`` picks it from the config."""

from __future__ import annotations

from vllm_sparse.config import SparseConfig
from vllm_sparse.selectors.base import Selection, Selector
from vllm_sparse.selectors.quoka import QuokaSelector

IMPLEMENTED_METHODS = ("quoka",)


def make_selector(config: SparseConfig) -> Selector:
    if config.method == "quoka":
        return QuokaSelector(config.quoka.num_queries)
    raise NotImplementedError(
        f"sparse_{config.method} is not implemented yet; implemented: "
        + ", ".join(f"sparse_{m}" for m in IMPLEMENTED_METHODS)
    )


__all__ = ["IMPLEMENTED_METHODS", "QuokaSelector", "Selection", "Selector", "make_selector"]
