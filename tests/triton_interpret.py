"""Triton kernel tests without a GPU: import this module before anything that imports triton.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``,
set here). Triton reads the variable when it is first imported (its own library functions are
jitted then); if another module of this pytest process imported it before (vLLM does), the test
file is re-run in a fresh process instead: ``test_in_fresh_process = rerun_in_fresh_process(__file__)``.
With CUDA the kernels run compiled on the GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
FRESH = not HAS_CUDA and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not HAS_CUDA and not FRESH:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if HAS_CUDA else "cpu"
in_process = pytest.mark.skipif(FRESH, reason="triton was imported before TRITON_INTERPRET=1: run in a fresh process")


def rerun_in_fresh_process(path: str):
    """A test that runs the test file ``path`` in a fresh interpreted process (when needed)."""

    @pytest.mark.skipif(not FRESH, reason="kernels run in this process")
    def test_in_fresh_process():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
            capture_output=True,
            text=True,
            env=env,
            cwd=os.path.dirname(os.path.dirname(path)),
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        passed = re.search(r"(\d+) passed", proc.stdout)
        assert passed and int(passed.group(1)) > 0, "the fresh process passed no test:\n" + proc.stdout[-4000:]

    return test_in_fresh_process
