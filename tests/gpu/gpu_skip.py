"""GPU tests: every module here skips, with the reason, where CUDA (or FlashInfer) is absent."""

import importlib.util

import pytest
import torch


def require_cuda(flashinfer: bool = False) -> None:
    """Skip the calling test module unless CUDA (and optionally FlashInfer) is present."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: GPU tests skipped", allow_module_level=True)
    if flashinfer and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed: FlashInfer tests skipped", allow_module_level=True)
