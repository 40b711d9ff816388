"""GPU tests: every module here skips, with the reason, where CUDA (or FlashInfer) is absent."""

import importlib.util
from contextlib import contextmanager

import pytest
import torch


def require_cuda(flashinfer: bool = False) -> None:
    """Skip the calling test module unless CUDA (and optionally FlashInfer) is present."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: GPU tests skipped", allow_module_level=True)
    if flashinfer and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed: FlashInfer tests skipped", allow_module_level=True)


@contextmanager
def no_sync():
    """Fail on any device-to-host synchronisation inside the block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
