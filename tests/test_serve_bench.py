"""benchmarks/serve_bench.py: how a label's variants become a server's sparse config and command line (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from serve_bench import LOADS, Served, bench_args, profile_skip_steps, server_cmd, server_env, server_settings  # noqa: E402

BASE = {"budget": {"fraction": 0.125}}
VARIANTS = {"b32": {"server_args": ["--block-size", 32]}, "d8": {"layers": {"8": {"sparse_decode": False}}}}


def test_sparse_variants_merge_into_the_config_and_the_command_line():
    backend, cfg, extra = server_settings("sparse_quest+d8+b32+sparse_decode", BASE, VARIANTS)
    assert backend == "sparse_quest" and extra == ["--block-size", "32"]
    assert cfg == {**BASE, "layers": {"8": {"sparse_decode": False}}, "sparse_decode": True}
    assert BASE == {"budget": {"fraction": 0.125}} and VARIANTS["b32"] == {"server_args": ["--block-size", 32]}
    cmd = server_cmd(Path("/m"), backend, 8000, cfg, extra_args=extra)
    assert cmd[-2:] == ["--block-size", "32"] and "--additional-config" in cmd


def test_dense_backends_take_server_args_only():
    assert server_settings("FLASH_ATTN+b32", BASE, VARIANTS) == ("FLASH_ATTN", None, ["--block-size", "32"])
    assert server_settings("FLASH_ATTN", BASE, VARIANTS) == ("FLASH_ATTN", None, [])
    with pytest.raises(SystemExit, match="dense backend"):
        server_settings("FLASH_ATTN+d8", BASE, VARIANTS)
    with pytest.raises(SystemExit, match="unknown variant"):
        server_settings("sparse_quest+nope", BASE, VARIANTS)


def test_variants_set_server_environment_variables_on_any_backend():
    variants = {**VARIANTS, "nopdl": {"env": {"VLLM_SPARSE_PDL": 0}}}
    assert server_settings("sparse_quest+nopdl+b32", BASE, variants) == ("sparse_quest", BASE, ["--block-size", "32"])
    assert server_settings("FLASH_ATTN+nopdl", BASE, variants) == ("FLASH_ATTN", None, [])
    assert server_env("sparse_quest+nopdl+b32", variants) == {"VLLM_SPARSE_PDL": "0"}
    assert server_env("sparse_quest", variants) == {}


def test_profiled_steps_start_after_every_prompt_is_prefilled():
    # one 130K prompt: 16 chunks of 8192, then 8 decode steps
    assert profile_skip_steps("prof128k", 8192) == 16 + 8
    # 16 prompts of 16K arriving together: 256,000 prefill tokens in 32 chunks, then 8 steps decoding all 16
    assert profile_skip_steps("prof16x16k", 8192) == 32 + 8
    assert profile_skip_steps("prof16k", 2048) == 8 + 8
    # a real model's 16 eval prompts of 32,512 tokens: 64 chunks, then 8 steps decoding all 16, then 24 profiled
    # steps, all before the first-prefilled request (decoding beside the last 60 chunks) has its 128 tokens
    assert profile_skip_steps("prof_real32k_x16", 8192) == 64 + 8
    assert 60 + 8 + 24 < LOADS["prof_real32k_x16"]["output"] and LOADS["prof_real32k_x16"]["eval"]


def test_a_real_model_is_served_with_its_weights_and_the_eval_loads_use_its_prompts(tmp_path):
    real = Served(Path("/models/qwen"), "qwen2.5-coder-1.5b-instruct", real=True, max_model_len=32768)
    cmd = server_cmd(real, "sparse_compact", 8000, {"budget": {"fraction": 0.25}})
    for flag, value in (("--load-format", "auto"), ("--max-model-len", "32768"),
                        ("--served-model-name", "qwen2.5-coder-1.5b-instruct")):  # fmt: skip
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[cmd.index("serve") + 1] == "/models/qwen"
    args = bench_args(real, 8000, "real32k", tmp_path, "x.json")
    assert args[args.index("--dataset-name") + 1] == "custom" and "--skip-chat-template" in args
    assert args[args.index("--dataset-path") + 1] == str(tmp_path / "prompts_real32k.jsonl")
    assert args[args.index("--model") + 1] == "qwen2.5-coder-1.5b-instruct"
    synthetic = server_cmd(Path("/m"), "FLASH_ATTN", 8000, None)
    assert synthetic[synthetic.index("--load-format") + 1] == "dummy"
    assert bench_args(real, 8000, "decode16", tmp_path, "y.json")[bench_args(real, 8000, "decode16", tmp_path,
                                                                            "y.json").index("--dataset-name") + 1] == "random"  # fmt: skip
    with pytest.raises(SystemExit, match="real model"):
        bench_args(Path("/m"), 8000, "real32k", tmp_path, "z.json")


def test_the_eval_loads_prompts_come_from_the_accuracy_eval_and_fit_the_model(tiny_llama, tmp_path):
    import json

    from serve_bench import EVAL_TASKS, LOADS, eval_prompts

    model = Served(Path(tiny_llama), "tiny", real=True, max_model_len=2048)
    path = eval_prompts(model, "real16k", tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == LOADS["real16k"]["prompts"]
    assert [r["task"] for r in rows] == [t for t in EVAL_TASKS for _ in range(len(rows) // len(EVAL_TASKS))]
    assert all(1500 < r["prompt_tokens"] <= 2048 for r in rows)  # the eval's length, capped by the model's
    assert len({r["prompt"] for r in rows}) == len(rows)
    path.write_text("kept\n")
    assert eval_prompts(model, "real16k", tmp_path).read_text() == "kept\n"  # made once per results folder
