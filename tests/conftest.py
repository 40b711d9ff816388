import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from tiny_model import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def run_engines(tmp_path_factory):
    """Run an engine spec in a fresh process (vLLM spawns its engine and worker from it)."""

    def run(spec: dict, timeout: int = 900) -> tuple[dict, str]:
        d = tmp_path_factory.mktemp("engine")
        spec_path, out_path = d / "spec.json", d / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        proc = subprocess.run(
            [sys.executable, str(TESTS / "engine_runner.py"), str(spec_path), str(out_path)],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
        log = proc.stdout + proc.stderr
        (d / "log.txt").write_text(log)
        if proc.returncode != 0 or not out_path.exists():
            raise AssertionError(f"engine runner failed (rc={proc.returncode}):\n{log[-6000:]}")
        return json.loads(out_path.read_text()), log

    return run


# Skips the CPU machine must never need: where CI sets VLLM_SPARSE_CI=1 (.ci/run), a test skipped for
# one of these reasons fails the session instead of passing silently.
FORBIDDEN_SKIPS = (
    "triton is not installed",
    "could not import 'triton'",
    "could not import 'vllm",
    "CPU ops",
    "no C++ compiler",
    "(test extra) is not installed",
)
_forbidden: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and os.environ.get("VLLM_SPARSE_CI") == "1":
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if any(f.lower() in reason.lower() for f in FORBIDDEN_SKIPS):
            _forbidden.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _forbidden:
        print("\nerror: tests skipped for reasons the CI machine must never have:\n  " + "\n  ".join(_forbidden))
        session.exitstatus = 1
