"""End to end through vLLM on the GPU, eager and in vLLM's default mode (torch.compile, full CUDA
graphs for decode batches): with a budget covering the context, sparse_quoka (dense shortcut) and
every method forced through its selection path (``force_sparse``: selection, tables, sparse
executor, the device decode path replayed from CUDA graphs) give FLASH_ATTN's greedy tokens; a
real budget skips pages, in prefill and in decode.

A small random-weight Llama (GQA 8/2, head_dim 128, fp16: see ``e2e_gpu.tiny``), prompts of different lengths in one
batch, chunked prefill in 100-token chunks (chunks start inside 16-token pages, decodes mixed
with prefill chunks), then a batch that hits the prefix cache. Each engine runs in its own subprocess (``benchmarks/e2e_gpu.py``),
so the plugin must load through its entry point. Needs vLLM >= 0.32 with CUDA and this package
installed (``pip install -e .``); several minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from gpu_skip import require_cuda

require_cuda(flashinfer=True)
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import e2e_gpu

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # the JSON that `python benchmarks/e2e_gpu.py tiny --out DIR` wrote in this session (to check a
    # run whose logs were kept, without running its 14 engines again)
    done = os.environ.get("VLLM_SPARSE_E2E_TINY_JSON")
    if done:
        return json.loads(Path(done).read_text())
    args = type("Args", (), {})()
    args.workdir = str(tmp_path_factory.mktemp("e2e"))
    args.modes = "eager,compile"
    args.parallel = True
    args.deadline_at = time.monotonic() + 3600
    return e2e_gpu.tiny(args)


def test_plugin_entry_point_registered(results):
    for name, r in results["runs"].items():
        assert r.get("ok"), f"{name}: {r.get('error') or r.get('log_tail')}"
        assert r["plugin"]["registered"], r["plugin"]


def _tie_bound(s: dict, mode: str) -> float:
    """The near-tie bound of a mode (``e2e_gpu.tie_bound``): from the gaps at which the two dense
    backends part in this very run, at least ``e2e_gpu.NEAR_TIE``."""
    return e2e_gpu.tie_bound(s[f"{mode}: flashinfer vs flash_attn"]["greedy"]["max_ref_gap_at_divergence"])


def _matches_dense(s: dict, mode: str, name: str) -> None:
    """Prompt logprobs as close to FLASH_ATTN's as FLASHINFER's are; greedy tokens equal FLASH_ATTN's
    up to a near-tie of the reference's logits (the reference's top-5 at the first divergence)."""
    cmp, floor = s[f"{mode}: {name} vs flash_attn"], s[f"{mode}: flashinfer vs flash_attn"]
    assert cmp["prompt_logprobs"]["mean_abs"] <= 2 * floor["prompt_logprobs"]["mean_abs"] + 1e-3, (cmp, floor)
    if not cmp["greedy"]["all_equal"]:
        gap = cmp["greedy"]["max_ref_gap_at_divergence"]
        assert gap is not None and gap < _tie_bound(s, mode), cmp["greedy"]["prompts"]


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_full_budget_matches_dense(results, mode):
    """Teacher-forced prompt logprobs (chunked prefill, chunks inside pages) equal dense's: the
    dense prefill rows run vLLM's FlashAttention where it is built (FLASH_ATTN's kernel), else
    FlashInfer per row (FLASHINFER's)."""
    s = results["summary"]
    nearest = min(s[f"{mode}: sparse_full vs {ref}"]["prompt_logprobs"]["max_abs"] for ref in ("flashinfer", "flash_attn"))
    assert nearest <= 1e-3, nearest
    _matches_dense(s, mode, "sparse_full")


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("method", e2e_gpu.FORCED_METHODS)
def test_selection_path_with_every_page_matches_dense(results, mode, method):
    """Every row through selection, tables and the sparse executors (prefill: vLLM's FlashAttention
    over the rows; decode: the device path, from CUDA graphs in compile mode), every page selected."""
    run = results["runs"][f"{mode}_forced_{method}"]
    assert run.get("ok"), run.get("error") or run.get("log_tail")
    assert run["sparse_stats"]["sparse_rows"] > 0, run["sparse_stats"]
    _matches_dense(results["summary"], mode, f"forced_{method}")


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_async_scheduling_is_on_and_exact_and_so_is_sync(results, mode):
    """vLLM 0.33 schedules asynchronously on GPUs by default (the next step is scheduled before the
    last one's tokens are back, so the builder must plan from exact lengths): every forced run above
    ran so and matched dense; Quest forced with ``async_scheduling=False`` matches dense too."""
    runs = results["runs"]
    assert all(runs[f"{mode}_forced_{m}"]["async_scheduling"] for m in e2e_gpu.FORCED_METHODS)
    sync = runs[f"{mode}_forced_quest_sync"]
    assert sync.get("ok"), sync.get("error") or sync.get("log_tail")
    assert sync["async_scheduling"] is False and sync["sparse_stats"]["sparse_rows"] > 0
    _matches_dense(results["summary"], mode, "forced_quest_sync")


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_quest_on_its_default_pages_of_32_matches_dense(results, mode):
    """With no block size given, vLLM takes Quest's preferred pages of 32 (``get_preferred_block_size``;
    the dense runs keep 16), and the forced selection path is still exact: a chunk of 100 tokens
    starts inside a page of 32 as well."""
    run = results["runs"][f"{mode}_forced_quest_default_pages"]
    assert run.get("ok"), run.get("error") or run.get("log_tail")
    assert run["block_size"] == 32 and results["runs"][f"{mode}_flash_attn"]["block_size"] == 16
    assert run["sparse_stats"]["sparse_rows"] > 0, run["sparse_stats"]
    _matches_dense(results["summary"], mode, "forced_quest_default_pages")


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_full_budget_runs_dense_and_real_budget_skips_pages(results, mode):
    """Counters over prefill and decode rows (decode rows counted by the metadata builder, since a
    replayed CUDA graph runs no Python)."""
    full = results["runs"][f"{mode}_sparse_full"]["sparse_stats"]
    real = results["runs"][f"{mode}_sparse_real"]["sparse_stats"]
    assert full["steps"] > 0 and full["attended_share"] == 1.0
    assert real["sparse_rows"] > 0 and real["attended_share"] < 0.9
    assert real["prefill_attended_share"] < 0.9


def _our_kernels() -> set[str]:
    """Names of every Triton kernel in vllm_sparse: the functions under ``@triton.jit`` (any name,
    ``block_stats_kernel`` as well as ``_attn_kernel``)."""
    src = Path(__file__).resolve().parents[2] / "vllm_sparse"
    jit = re.compile(r"^@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)\(", re.M)
    return {m for f in src.rglob("*.py") for m in jit.findall(f.read_text())}


def _jit_runs(results) -> dict[str, set[str]]:
    ours = _our_kernels()
    return {
        name: set(run.get("jit_during_inference", [])) & ours
        for name, run in results["runs"].items()
        if "sparse" in name or "forced" in name
    }


def test_no_sparse_kernel_compiles_while_serving(results):
    """vLLM's JIT monitor (active after start-up) saw none of our kernels compile: the start-up
    warm-up (vllm_sparse.warmup) and CUDA-graph capture compiled every variant a step takes."""
    runs = _jit_runs(results)
    assert "compile_forced_kascade" in runs  # Kascade's prefill anchor kernels, compile mode included
    for name, compiled in runs.items():
        assert not compiled, (name, compiled)
