"""Stage 0: writing this step's K/V (and, for methods that need it, page metadata) into the pages."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

from vllm_sparse.metadata.writer import write_kv_reference

KVWriter = Callable[..., None]
logger = logging.getLogger(__name__)
_warned: set[str] = set()


def get_kv_writer(device_type: str) -> KVWriter:
    """The K/V writer for a platform (``"cpu"``, ``"cuda"``); signature of ``write_kv_reference``.

    On CUDA: the Triton kernel ``kernels.kv_write.write_kv_triton``; without ``triton``, the torch
    reference, with one warning.
    """
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is not None:
            from vllm_sparse.kernels.kv_write import write_kv_triton

            return write_kv_triton
        msg = "vllm-sparse: triton is not installed; using the torch reference K/V writer"
        if msg not in _warned:
            _warned.add(msg)
            logger.warning(msg)
    return write_kv_reference


def get_decode_step_writer(device_type: str) -> KVWriter | None:
    """The one-launch writer of a decode step's K/V and page metadata
    (``kernels.kv_write.write_decode_step_triton``) on CUDA with triton; None elsewhere (the
    generic writers then run: ``get_kv_writer`` and the metadata writers)."""
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        from vllm_sparse.kernels.kv_write import write_decode_step_triton

        return write_decode_step_triton
    return None


__all__ = ["KVWriter", "get_decode_step_writer", "get_kv_writer", "write_kv_reference"]
