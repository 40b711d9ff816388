"""benchmarks/decode_trace.py: a served decode step's period, GPU busy and idle time from a trace."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from decode_trace import category, report, step_report  # noqa: E402


def synthetic_trace(steps: int, period: float, kernels: list[tuple[str, float]], launch_cost: float = 5.0) -> list:
    """``steps + 1`` graph launches ``period`` us apart; after each launch but the last, the kernels
    run back to back (name, duration), starting ``launch_cost`` us after it."""
    events = [{"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": 0.0, "dur": 3.0}]
    for s in range(steps):
        t = s * period + launch_cost
        for name, dur in kernels:
            events.append({"name": name, "cat": "kernel", "ts": t, "dur": dur})
            t += dur
        events.append({"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": (s + 1) * period, "dur": 3.0})
    events.append({"name": "aten::add", "cat": "cpu_op", "ts": 1.0, "dur": 500.0})  # host ops do not count
    return events


def test_busy_and_idle_per_step():
    kernels = [("attn", 30.0), ("gemm", 60.0), ("copy", 10.0)]
    r = step_report(synthetic_trace(8, 150.0, kernels))
    assert r["steps"] == 8 and r["period_us"] == 150.0
    assert r["busy_us"] == 100.0 and r["idle_us"] == 50.0
    assert r["kernels"][0] == ("gemm", 60.0) and dict(r["kernels"])["attn"] == 30.0


def test_a_gpu_bound_step_has_no_idle_time():
    r = step_report(synthetic_trace(4, 100.0, [("attn", 95.0)], launch_cost=0.0))
    assert r["idle_us"] == 5.0 and r["busy_us"] == 95.0
    assert step_report(synthetic_trace(0, 100.0, [("attn", 95.0)])) is None  # one launch: no step


@pytest.mark.parametrize("gz", [False, True])
def test_report_picks_the_worker_trace_in_a_folder(tmp_path, gz):
    worker = {"traceEvents": synthetic_trace(5, 200.0, [("attn", 50.0)])}
    frontend = {"traceEvents": [{"name": "aten::empty", "cat": "cpu_op", "ts": 0.0, "dur": 1.0}]}
    (tmp_path / "frontend.pt.trace.json").write_text(json.dumps(frontend))
    name = "rank0.pt.trace.json" + (".gz" if gz else "")
    if gz:
        with gzip.open(tmp_path / name, "wt") as f:
            json.dump(worker, f)
    else:
        (tmp_path / name).write_text(json.dumps(worker))
    r = report(tmp_path)
    assert r["trace"].endswith(name) and r["steps"] == 5 and r["idle_us"] == 150.0


def test_kernel_time_per_category():
    kernels = [
        ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>", 40.0),
        ("void cutlass::device_kernel<flash::FlashAttnFwdCombine<...>>", 4.0),
        ("_decode_attn_kernel", 20.0),
        ("_decode_merge_kernel", 5.0),
        ("_split_fused_kernel", 16.0),
        ("_quest_decode_bounds_kernel", 10.0),
        ("_write_kernel", 3.0),
        ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>", 2.0),
        ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", 100.0),
        ("triton_red_fused_fused_add_rms_norm_0", 7.0),
    ]
    r = step_report(synthetic_trace(3, 400.0, kernels))
    assert r["categories"] == {
        "merge": 9.0, "attention": 60.0, "selection": 26.0, "kv_write": 5.0, "gemm": 100.0, "other": 7.0
    }  # fmt: skip
    assert sum(r["categories"].values()) == r["busy_us"]
    assert category("_split_write_kernel") == "selection" and category("_int4_write_kernel") == "kv_write"


def test_idle_splits_into_host_gaps_and_launch_gaps():
    # per step of 150 us: three kernels 1 us apart (launch gaps inside the graph) from 5 us after the launch
    # to 101 us; the next step's first kernel starts 54 us after that (the host's gap)
    events = [{"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": 0.0, "dur": 3.0}]
    for s in range(4):
        t = s * 150.0 + 5.0
        for name, dur in (("attn", 30.0), ("gemm", 60.0), ("copy", 4.0)):
            events.append({"name": name, "cat": "kernel", "ts": t, "dur": dur})
            t += dur + 1.0
        events.append({"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": (s + 1) * 150.0, "dur": 3.0})
        events.append({"name": "aten::copy_", "cat": "cpu_op", "ts": s * 150.0 + 100.0, "dur": 6.0})
    r = step_report(events)
    assert r["busy_us"] == 94.0 and r["idle_us"] == 56.0
    assert r["graph_gaps_us"] == 2.0  # two 1-us gaps between the nodes of a step
    assert r["host_gaps_us"] == 54.0  # 155 - 101: from one step's last kernel to the next step's first
    assert r["host_gaps_before"] == [("attn", 40.5)]  # three such gaps over four steps (the first has none)
    assert r["graph_gaps_before"] == [("gemm", 1.0), ("copy", 1.0)]
    assert r["cpu_ops"] == [("aten::copy_", 1.0, 6.0)]
