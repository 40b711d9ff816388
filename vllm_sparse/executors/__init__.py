"""Stage 4: executors read K/V in place and attend over ragged page tables."""

from __future__ import annotations

from vllm_sparse.executors.base import Executor
from vllm_sparse.executors.reference import reference_executor


def get_executor(device_type: str) -> Executor:
    """The executor for a platform (``"cpu"``, ``"cuda"``); the torch reference runs anywhere."""
    return reference_executor


__all__ = ["Executor", "get_executor", "reference_executor"]
