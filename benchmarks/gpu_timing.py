"""Shared by the GPU benchmarks: a CUDA-event timer with the L2 flushed before every repetition, and
the JSON every benchmark writes (what it measured, with the exact command and the machine)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch

#: How a ``Timer`` empties the L2 cache before each repetition:
#: ``write``: a 512 MiB write (Triton's ``do_bench`` way). It leaves the L2 full of dirty lines, which the timed
#:   kernel then writes back as it reads: about 50 MB of extra DRAM traffic, small beside a dense 128K layer's
#:   512 MiB but as much as a sparse layer's 64 MiB of K/V.
#: ``read``: a 512 MiB read, which leaves the L2 holding clean lines the kernel evicts for free (cold L2 as a
#:   layer in a served step finds it after the weight GEMMs, which read and write little).
#: ``none``: nothing (warm L2: inputs smaller than the L2 stay there between repetitions).
FLUSH_MODES = ("write", "read", "none")


class Timer:
    """Median of CUDA-event times, L2 emptied before every repetition (``flush``, see ``FLUSH_MODES``)."""

    def __init__(self, reps: int, warmup: int = 3, flush: str = "write"):
        if flush not in FLUSH_MODES:
            raise ValueError(f"flush must be one of {FLUSH_MODES}, got {flush!r}")
        self.reps, self.warmup, self.flush = reps, warmup, flush
        self.flush_buf = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        self._flush_sum = torch.empty((), dtype=torch.int64, device="cuda")
        self._flush_words = self.flush_buf.view(torch.int64)

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.flush == "write":
                self.flush_buf.zero_()
            elif self.flush == "read":
                torch.sum(self._flush_words, 0, out=self._flush_sum)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def bench_setup(out: str, reps: int, head_dim: int, page_size: int, flush: str = "write"):
    """What every per-layer GPU benchmark starts with: its output folder (made), the timer and vLLM's
    dense FlashAttention for the shapes. Returns ``(out, timer, dense)``."""
    from vllm_sparse.backend.dense_prefill import DensePrefill

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    dense = DensePrefill.create(head_dim, page_size)
    assert dense is not None, "no FlashAttention in this vLLM build"
    return path, Timer(reps, flush=flush), dense


def graphed(fn, count: int = 1):
    """``count`` calls of ``fn`` captured back to back in one CUDA graph (run once before, to
    compile): its replay (a layer's cost inside vLLM's full graph is its time divided by ``count``)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            fn()
    return graph.replay


def write_results(path: Path, benchmark: str, method: str, results: list, **extra) -> None:
    """``path``: the benchmark's JSON (its description, the command that ran it, the GPU, torch, how
    it timed, ``extra`` fields and the results)."""
    doc = {
        "benchmark": benchmark,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "method": method,
        **extra,
        "results": results,
    }
    Path(path).write_text(json.dumps(doc, indent=1))
