"""benchmarks/gpu_preflight.py: a GPU job stops at once when vLLM would not load the plugin."""

import sys
from importlib.metadata import EntryPoint
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from gpu_preflight import GROUP, NAME, plugin_problems  # noqa: E402

OURS = EntryPoint(NAME, "vllm_sparse:register", GROUP)
OTHER = EntryPoint("other_plugin", "other:register", GROUP)


def test_this_environment_has_the_plugin_installed():
    assert plugin_problems() == []


def test_a_missing_entry_point_is_reported():
    problems = plugin_problems(eps=[OTHER])
    assert len(problems) == 1 and "entry point" in problems[0] and "gpu_setup.sh" in problems[0]


def test_every_reason_at_once():
    problems = plugin_problems(eps=[], find_spec=lambda name: None)
    assert len(problems) == 3
    assert [p.split()[0] for p in problems[:2]] == ["vllm", "vllm_sparse"]


def test_registered_and_importable_is_fine():
    assert plugin_problems(eps=[OTHER, OURS], find_spec=lambda name: object()) == []
