"""Refuse a GPU job in seconds when the plugin is not installed where vLLM will look for it.

A lent GPU host copies the working tree afresh for every command; vLLM finds backends through the
``vllm.general_plugins`` entry point that ``pip install`` (``benchmarks/gpu_setup.sh``) registers. Without it
every engine fails at start (``Unknown attention backend: 'SPARSE_QUOKA'``) and every server script at its
first import, after the staging and the compile-free stages have already spent device time (session 41).

    python3 benchmarks/gpu_preflight.py        # exit 2 with the reasons, else prints what it found
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.metadata import entry_points

GROUP, NAME = "vllm.general_plugins", "vllm_sparse"


def plugin_problems(eps=None, find_spec=importlib.util.find_spec) -> list[str]:
    """Every reason vLLM would not load vllm-sparse in a fresh process (empty: it would).

    Args:
        eps: the entry points of ``GROUP`` (default: this environment's).
        find_spec: ``importlib.util.find_spec`` (a test replaces it).
    """
    problems = []
    for module in ("vllm", "vllm_sparse"):
        if find_spec(module) is None:
            problems.append(f'{module} is not importable (PYTHONPATH: eval "$(bash benchmarks/gpu_setup.sh)")')
    eps = list(entry_points(group=GROUP) if eps is None else eps)
    if not any(ep.name == NAME for ep in eps):
        problems.append(
            f"no {GROUP} entry point named {NAME}: vLLM will not register the sparse backends "
            '(install the package: eval "$(bash benchmarks/gpu_setup.sh)")'
        )
    return problems


def main() -> int:
    problems = plugin_problems()
    if problems:
        print("gpu_preflight: vllm-sparse would not load:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    print("gpu_preflight: vllm and the vllm_sparse plugin entry point are installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
