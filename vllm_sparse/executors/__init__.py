"""Stage 4: executors read K/V in place and attend over ragged page tables."""

from __future__ import annotations

import importlib.util
import logging

from vllm_sparse.executors.base import Executor
from vllm_sparse.executors.reference import reference_executor

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def get_executor(device_type: str) -> Executor:
    """The executor for a platform (``"cpu"``, ``"cuda"``); the torch reference runs anywhere.

    On CUDA: the FlashInfer executor (one instance shared by all layers, so that a step is planned
    once); without ``flashinfer`` installed, the torch reference, with one warning.
    """
    if device_type == "cuda":
        if importlib.util.find_spec("flashinfer") is not None:
            from vllm_sparse.executors.flashinfer import flashinfer_executor

            return flashinfer_executor()
        _warn_once("vllm-sparse: flashinfer is not installed; using the slow torch reference executor")
    return reference_executor


def __getattr__(name: str):
    """``TritonPagedExecutor`` (variable per-row page counts on the device), imported on first use
    (it needs ``triton``)."""
    if name == "TritonPagedExecutor":
        from vllm_sparse.executors.triton_paged import TritonPagedExecutor

        return TritonPagedExecutor
    raise AttributeError(name)


__all__ = ["Executor", "TritonPagedExecutor", "get_executor", "reference_executor"]
