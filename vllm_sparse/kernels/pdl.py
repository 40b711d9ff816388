"""Programmatic dependent launch (PDL) of the decode kernels that follow each other in a layer (opt-in).

A decode layer launches a short chain of kernels (K/V write, selection, attention, merge), each a few
to a few tens of microseconds, and in a CUDA graph the GPU idles between them for the launch of the
next (session 32's trace of Quest's 16 x 16K step: 259 us of in-graph gaps per step, no host gap).
With PDL (Hopper and later) a kernel of the chain is launched while the one before still runs:
its programs become resident as the earlier kernel's last programs start, and wait at
``griddepcontrol.wait`` until that kernel has finished and its writes are visible. So every chain
kernel starts with ``pdl_wait_then_release``: wait first (before reading anything an earlier kernel
may write), then let the next kernel launch.

Off by default: served on an H100 (session 32, Quest, 16 x 16K) the step took 9.31 ms with it against
9.02 ms without, and 8.22 against 8.19 ms after 130K: the next kernel's programs, resident from the
start of the one before, cost more than the launch gaps they hide. ``VLLM_SPARSE_PDL=1`` turns it on
(for measuring other placements of the release).

A kernel that waits this way is correct with or without PDL (the wait returns at once when the
launch had no programmatic dependency), so ``USE_PDL`` only decides whether the instructions are
compiled in (never under Triton's interpreter) and ``launch_options`` whether the launch asks for
PDL.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "VLLM_SPARSE_PDL"


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether the chain kernels on ``device`` launch with PDL: ``VLLM_SPARSE_PDL=1``, a CUDA GPU of compute
    capability 9 or later, and compiled kernels (not Triton's interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1" or os.environ.get(ENV, "0") != "1":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Keyword arguments of a chain kernel's launch: its ``USE_PDL`` constant and Triton's ``launch_pdl``."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}


@triton.jit
def pdl_wait_then_release(USE_PDL: tl.constexpr):
    """Wait until the kernel launched before this one has finished (its writes visible), then allow the
    next kernel to launch; nothing without ``USE_PDL``. Call it before the kernel's first load."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
