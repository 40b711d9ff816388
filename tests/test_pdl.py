"""kernels/pdl.py: which launches ask for programmatic dependent launch (no GPU here): only with
VLLM_SPARSE_PDL=1, never on CPUs or under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from vllm_sparse.kernels import pdl


def test_cpu_launches_compile_no_pdl(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "1")
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}


@pytest.mark.parametrize("env", [{"TRITON_INTERPRET": "1", pdl.ENV: "1"}, {pdl.ENV: "0"}, {}])
def test_off_by_default_and_under_the_interpreter_before_asking_the_gpu(monkeypatch, env):
    monkeypatch.setattr(pdl, "_supported", lambda index: pytest.fail("the GPU must not be asked"))
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert not pdl.pdl_enabled(torch.device("cuda", 0))


@pytest.mark.parametrize("capability,want", [(8, False), (9, True), (10, True)])
def test_when_asked_gpus_from_hopper_on_launch_with_pdl(monkeypatch, capability, want):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setattr(pdl, "_supported", lambda index: capability >= 9)
    assert pdl.pdl_enabled(torch.device("cuda", 0)) is want
    assert pdl.launch_options(torch.device("cuda", 0)) == (
        {"USE_PDL": True, "launch_pdl": True} if want else {"USE_PDL": False}
    )
