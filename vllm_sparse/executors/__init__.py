"""Stage 4: executors read K/V in place and attend over ragged page tables."""

from vllm_sparse.executors.base import Executor
from vllm_sparse.executors.reference import reference_executor

__all__ = ["Executor", "reference_executor"]
