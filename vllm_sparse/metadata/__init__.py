"""Stage 0: writing this step's K/V (and, for methods that need it, page metadata) into the pages."""

from vllm_sparse.metadata.writer import write_kv_reference

__all__ = ["write_kv_reference"]
