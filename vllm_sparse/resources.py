"""Where the package's data folders are: the top-level ``configs/`` (shipped selector configs) and
``csrc/`` (native CPU sources) of the repository, installed as the subpackages ``vllm_sparse.configs``
and ``vllm_sparse.csrc`` (``pyproject.toml`` maps them with setuptools' ``package-dir``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def data_dir(name: str) -> Path:
    """The folder of ``vllm_sparse.<name>`` (wheel or editable install), else ``<repo>/<name>`` (a
    source checkout on ``sys.path`` without an install)."""
    try:
        spec = importlib.util.find_spec(f"vllm_sparse.{name}")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return _REPO / name
