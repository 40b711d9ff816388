"""Stage 0: writing this step's K/V (and, for methods that need it, page metadata) into the pages."""

from __future__ import annotations

from collections.abc import Callable

from vllm_sparse.metadata.writer import write_kv_reference

KVWriter = Callable[..., None]


def get_kv_writer(device_type: str) -> KVWriter:
    """The K/V writer for a platform (``"cpu"``, ``"cuda"``); signature of ``write_kv_reference``."""
    return write_kv_reference


__all__ = ["KVWriter", "get_kv_writer", "write_kv_reference"]
