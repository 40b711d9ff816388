"""The package as installed: the top-level ``configs/`` and ``csrc/`` travel inside the wheel as
``vllm_sparse.configs`` and ``vllm_sparse.csrc``, the native CPU ops build from the installed
sources, and pyproject's package list names every package folder."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _pyproject_packages() -> list[str]:
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^packages = \[(.*?)\]", text, re.S | re.M).group(1)
    return re.findall(r'"([\w.]+)"', block)


def test_every_package_folder_is_listed():
    found = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "vllm_sparse").rglob("__init__.py")
    }
    listed = set(_pyproject_packages())
    assert found <= listed, f"missing from pyproject packages: {sorted(found - listed)}"
    assert {"vllm_sparse.configs", "vllm_sparse.csrc"} <= listed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "repo"  # a copy: setuptools writes build/ into the tree it builds
    skip = shutil.ignore_patterns(".git", ".venv", ".stage", ".whl", "build", "*.egg-info", "__pycache__", "results")
    shutil.copytree(REPO, src, ignore=skip)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("vllm_sparse-*.whl")
    return path


def test_wheel_carries_configs_and_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for yaml in (REPO / "configs").glob("*.yaml"):
        assert f"vllm_sparse/configs/{yaml.name}" in names
    for src in [*(REPO / "csrc").glob("*.cpp"), *(REPO / "csrc").glob("*.h")]:
        assert f"vllm_sparse/csrc/{src.name}" in names
    assert not any(n.startswith(("configs/", "csrc/")) for n in names), "data folders leaked to the top level"


def test_installed_copy_finds_configs_and_builds_native_ops(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        timeout=300,
    )
    probe = (
        "import vllm_sparse.config as c, vllm_sparse.kernels.cpu_native as n, pathlib;"
        "site = pathlib.Path(__import__('sys').argv[1]).resolve();"
        "assert c.SHIPPED_DIR.resolve().is_relative_to(site), c.SHIPPED_DIR;"
        "assert n.CSRC.resolve().is_relative_to(site), n.CSRC;"
        "assert list(c.SHIPPED_DIR.glob('*.yaml')) and n.SOURCES;"
        "print('native', n.available())"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "VLLM_SPARSE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(site)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "native True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
