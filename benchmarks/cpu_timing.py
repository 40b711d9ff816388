"""Shared by the CPU benchmarks: the CPU's name and a median wall-clock timer."""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path


def cpu_model() -> str:
    """The ``model name`` line of /proc/cpuinfo (else the platform's processor string)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def timed(fn, reps: int) -> float:
    """Median wall time of ``fn()`` in ms over ``reps`` runs, after one warm-up run."""
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3
