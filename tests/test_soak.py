"""The soak's CPU slice (issue 15, item 1): ``benchmarks/soak.py`` against the OpenAI-compatible
server on the random-weight tiny model, with the page metadata check on.

* Equality: the greedy stream (aborts left out) against dense CPU_ATTN and against sparse_quest,
  sparse_twilight and sparse_quoka at a covering budget through the selection path
  (``force_sparse``): every greedy request completed in both gives the same token ids, through
  preemptions and prefix-cache hits.
* A real budget (25%, sparse from 256 tokens) for sparse_quest and sparse_twilight with aborts,
  ``n = 2``, stop strings and logprobs: every request completes or is aborted by the client, none
  errs or hangs, at least one preemption and one prefix-cache hit happen, and the page metadata
  check (``SPARSE_ATTENTION_CHECK_META=1``) recomputed pages and found none stale.

The check itself is tested first, on a synthetic cache, to find what it must find.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import soak  # noqa: E402

from vllm_sparse.backend import meta_check  # noqa: E402
from vllm_sparse.layout import MetaPlanes, PageLayout  # noqa: E402
from vllm_sparse.metadata.int4_shadow import write_int4_shadow  # noqa: E402
from vllm_sparse.metadata.page_minmax import write_page_minmax  # noqa: E402
from vllm_sparse.metadata.writer import write_kv_reference  # noqa: E402

NUM_REQUESTS = 110
META_BACKENDS = ["sparse_quest", "sparse_twilight"]  # methods with page metadata (checked against the keys)
BACKENDS = META_BACKENDS + ["sparse_kascade", "sparse_compact"]  # covering and real budgets
COVERING_ONLY = ["sparse_quoka"]  # covering budget (QuoKA's real budget is the engine tests')
ORDER = ["twilight_covering", "twilight_real", "quest_covering", "quest_real", "kascade_covering", "kascade_real",
         "compact_covering", "compact_real", "dense", "quoka_covering"]  # fmt: skip


# --------------------------------------------------------------------------------------------
# The page metadata check finds stale pages
# --------------------------------------------------------------------------------------------


def _cache(method: str, order: str):
    """6 blocks of stale garbage (page 8, 2 KV heads, D 16) and a writer of K/V + metadata."""
    g = torch.Generator().manual_seed(7)
    hkv, n, d = 2, 8, 16
    planes = MetaPlanes.for_method(method, hkv, n, d, torch.float32)
    cache = torch.randn(6, hkv + planes.num_slots, n, 2 * d, generator=g)  # blocks are never zeroed
    layout = PageLayout.of(cache, hkv, order)
    meta = planes.views(cache)

    def write(slots: list[int]) -> torch.Tensor:
        slots = torch.tensor(slots)
        key, value = torch.randn(len(slots), hkv, d, generator=g), torch.randn(len(slots), hkv, d, generator=g)
        write_kv_reference(layout, cache, key, value, slots)
        if meta.kmin is not None:
            write_page_minmax(layout, cache, meta, slots)
        if meta.codes is not None:
            write_int4_shadow(meta, key, slots, n, torch.float32)
        return slots

    return layout, cache, meta, write


@pytest.mark.parametrize("order", ["planes", "interleaved"])
@pytest.mark.parametrize("method", ["quest", "twilight"])
def test_meta_check_passes_exact_pages_and_finds_stale_ones(method, order):
    layout, cache, meta, write = _cache(method, order)
    # request A: blocks 1 (full) and 3 (5 tokens, in two steps); request B: block 4 (4 tokens)
    assert meta_check.check_written("l", layout, cache, meta, write(list(range(8, 16)) + [24, 25, 26])) == 0
    assert meta_check.check_written("l", layout, cache, meta, write([27, 28, 32, 33, 34, 35])) == 0
    table, lens = torch.tensor([[1, 3], [4, 0]]), [13, 4]
    assert meta_check.check_requests("l", layout, cache, meta, table, lens) == 0
    blocks = torch.tensor([1, 3, 4])
    # a key changed behind the metadata's back (a write without its summary update) is found
    layout.keys(cache)[3, 1, 2] += 5.0
    assert meta_check.page_mismatches(layout, cache, meta, blocks, torch.tensor([8, 5, 4])).tolist() == [0, 1, 0]
    layout.keys(cache)[3, 1, 2] -= 5.0
    # so is a page read past what its summary covers (block 3 holds 5 tokens, read as 6)
    assert meta_check.check_requests("l", layout, cache, meta, table, [14, 4]) == 1
    # block 4 reused by a new owner: offsets 0..1 rewritten; the summary restarts at offset 0
    assert meta_check.check_written("l", layout, cache, meta, write([32, 33])) == 0
    assert meta_check.check_requests("l", layout, cache, meta, torch.tensor([[4]]), [2]) == 0
    if meta.codes is not None:  # Twilight: an INT4 shadow that is not its key's is found
        meta.codes[4, 1, 1, 3] ^= 1
        assert meta_check.check_requests("l", layout, cache, meta, torch.tensor([[4]]), [2]) == 1
        meta.codes[4, 1, 1, 3] ^= 1
    # a summary that kept the previous owner's keys (a running min/max, no reset) is found
    meta.kmin[4] = torch.minimum(meta.kmin[4], layout.keys(cache)[4, :, 2:4].amin(1))
    assert meta_check.check_requests("l", layout, cache, meta, torch.tensor([[4]]), [2]) == 1


def test_meta_check_is_off_by_default(monkeypatch):
    import importlib

    monkeypatch.delenv(meta_check.ENV, raising=False)
    assert not importlib.reload(meta_check).ENABLED
    monkeypatch.setenv(meta_check.ENV, "1")
    assert importlib.reload(meta_check).ENABLED
    monkeypatch.delenv(meta_check.ENV)
    importlib.reload(meta_check)
    assert soak.META_CHECK_ENV == meta_check.ENV and soak.META_MARKER == meta_check.MARKER


def test_the_stream_is_seeded_and_covers_every_kind():
    a = soak.make_requests(NUM_REQUESTS, 0, 1024)
    assert [r.prompt for r in a] == [r.prompt for r in soak.make_requests(NUM_REQUESTS, 0, 1024)]
    lens = [len(r.prompt) for r in a]
    assert min(lens) >= 200 and max(lens) <= 1024 - 16 - 8 and max(lens) > 900
    shared = [r for r in a if r.prefix_group is not None]
    assert 0.35 * len(a) <= len(shared) <= 0.65 * len(a)
    for kind in ("stream", "abort_after", "stop", "logprobs"):
        assert any(getattr(r, kind) for r in a), kind
    assert any(r.n > 1 for r in a) and not any(r.abort_after and not r.stream for r in a)


# --------------------------------------------------------------------------------------------
# The CPU slice
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slice_records(tiny_llama, tmp_path_factory):
    """Ten servers, two at a time, each on a core of its own: dense, five covering budgets, four
    real budgets, all over the same 110-request stream."""
    log_dir = tmp_path_factory.mktemp("soak")
    reqs = soak.make_requests(NUM_REQUESTS, 0, soak.ServerOptions().max_model_len)
    kw = {"progress": False}
    jobs = soak.equality_jobs(tiny_llama, BACKENDS + COVERING_ONLY, reqs, log_dir, "CPU_ATTN", **kw)
    common = {"model": tiny_llama, "requests": reqs, "log_dir": log_dir, **kw}
    jobs += [
        {**common, "backend": b, "sparse_cfg": soak.real_config(b), "name": f"{soak.method_of(b)}_real"}
        for b in BACKENDS
    ]
    for j in jobs:  # no metadata slots: a smaller cache, as few tokens as Quest's, so it preempts too
        if j["backend"] not in META_BACKENDS + ["CPU_ATTN"]:
            j["opts"] = soak.ServerOptions(kv_cache_bytes=5 << 20)
    jobs.sort(key=lambda j: ORDER.index(j["name"]))  # the slowest first: two servers at a time finish together
    records = soak.add_equality(soak.run_jobs(jobs, workers=2), reqs)
    summaries = {k: soak.summary(r) for k, r in records.items()}
    (log_dir / "summary.json").write_text(json.dumps(summaries, indent=1))
    print("\n" + "\n".join(json.dumps(s) for s in summaries.values()))
    return records


def _assert_clean(rec: dict) -> None:
    assert rec["server_alive"], rec["log"]
    assert rec["errors"] == 0 and rec["hangs"] == 0, rec["error_messages"]
    assert rec["mismatches"] == 0, (rec["mismatch_details"], rec.get("equality"))
    findings = rec["log_findings"]
    assert findings["tracebacks"] == 0 and findings["engine_dead"] == 0, rec["log"]


@pytest.mark.engine
@pytest.mark.parametrize("backend", BACKENDS + COVERING_ONLY)
def test_covering_budget_gives_dense_tokens_under_load(slice_records, backend):
    dense, run = slice_records["dense"], slice_records[f"{soak.method_of(backend)}_covering"]
    _assert_clean(dense)
    _assert_clean(run)
    assert dense["completed"] == run["completed"] == NUM_REQUESTS  # no aborts in equality mode
    assert (
        run["equality"]["compared"] == sum(r.n == 1 for r in soak.make_requests(NUM_REQUESTS, 0, 1024))
        and run["equality"]["token_mismatches"] == 0
    ), run["equality"]
    pc = run["page_counters"]
    assert pc["sparse_rows"] > 0 and pc["attended_pages"] == pc["dense_pages"], pc  # the selection path, every page
    if backend in META_BACKENDS:
        assert pc["meta_checked_pages"] > 0 and pc["meta_mismatched_pages"] == 0, pc
    assert run["preemptions"] >= 1 and run["prefix_cache_hit_requests"] >= 1


@pytest.mark.engine
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_budget_completes_everything_with_exact_page_metadata(slice_records, backend):
    rec = slice_records[f"{soak.method_of(backend)}_real"]
    _assert_clean(rec)
    assert rec["completed"] + rec["aborted"] == rec["requests"] == NUM_REQUESTS
    # only requests meant to be aborted are (one may finish before its chunk count: it completes)
    reqs = soak.make_requests(NUM_REQUESTS, 0, 1024)
    aborted = [o["idx"] for o in rec["outcomes"] if o["status"] == "aborted"]
    assert all(reqs[i].abort_after for i in aborted) and len(aborted) >= 0.7 * sum(bool(r.abort_after) for r in reqs)
    assert rec["preemptions"] >= 1, rec["metrics"]
    assert rec["prefix_cache_hit_requests"] >= 1 and rec["prefix_cache_hit_tokens"] > 0, rec["metrics"]
    pc = rec["page_counters"]
    assert pc["sparse_rows"] > 0 and pc["attended_pages"] < pc["dense_pages"], pc  # pages really skipped
    if backend in META_BACKENDS:
        assert pc["meta_checked_pages"] > 0 and pc["meta_mismatched_pages"] == 0, pc
    assert rec["log_findings"]["meta_mismatch_lines"] == []


# --------------------------------------------------------------------------------------------
# Equality with near-ties (GPUs), stream parsing, configs for every method
# --------------------------------------------------------------------------------------------


def _outcome(idx: int, tokens: list[int], tops: list[dict] | None = None) -> dict:
    return {"idx": idx, "status": "completed", "tokens": [tokens], "top_logprobs": [tops] if tops else []}


def test_near_ties_are_told_from_errors_by_the_reference_logprobs():
    reqs = [soak.SoakRequest(i, [1, 2], 4, False) for i in range(3)]
    tops = [{"5": -0.1, "6": -0.2}, {"7": -0.01, "8": -3.0}]  # position 0: a near-tie; position 1: not
    ref = {"outcomes": [_outcome(0, [5, 7], tops), _outcome(1, [5, 7], tops), _outcome(2, [5, 7], tops)]}
    run = {"outcomes": [_outcome(0, [6, 7]), _outcome(1, [5, 8]), _outcome(2, [5, 7])]}
    exact = soak.compare(ref, run, reqs)
    assert exact["token_mismatches"] == 2 and exact["near_ties"] == 0 and exact["max_ref_gap_at_divergence"] == 2.99
    tied = soak.compare(ref, run, reqs, tie_bound=0.26)
    assert tied["token_mismatches"] == 1 and tied["near_ties"] == 1 and tied["examples"][0]["idx"] == 1
    # a run's token outside the reference's top logprobs is never a near-tie
    far = soak.compare(ref, {"outcomes": [_outcome(0, [9, 7])]}, reqs, tie_bound=100.0)
    assert far["token_mismatches"] == 1 and far["max_ref_gap_at_divergence"] is None
    assert soak.tie_bound(exact) == 2 * 2.99 + 0.01 and soak.tie_bound(far) == soak.NEAR_TIE


def test_a_second_dense_run_sets_the_tie_bound_and_every_greedy_request_asks_for_logprobs():
    reqs = soak.make_requests(40, 0, 1024)
    eq = soak.equality_requests(reqs, near_ties=True)
    assert all(r.abort_after is None for r in eq)
    assert all(r.logprobs == soak.TIE_LOGPROBS for r in eq if r.n == 1)
    jobs = soak.equality_jobs("m", ["sparse_quest"], reqs, "/tmp", "FLASH_ATTN", second_dense="FLASHINFER")
    assert [(j["name"], j["backend"]) for j in jobs] == [
        ("dense", "FLASH_ATTN"), ("dense2", "FLASHINFER"), ("quest_covering", "sparse_quest")]  # fmt: skip
    assert [j["name"] for j in soak.equality_jobs("m", ["sparse_quest"], reqs, "/tmp")] == ["dense", "quest_covering"]


def test_stream_lines_split_at_newlines_only():
    import asyncio

    class Response:
        async def aiter_bytes(self):
            for part in (b'data: {"t": "a\xe2\x80\xa8b\xc2\x85', b'c"}\r\n\r\ndata: [DO', b"NE]\n"):
                yield part

    async def lines():
        return [x async for x in soak._sse_lines(Response())]

    got = asyncio.run(lines())
    assert got == ['data: {"t": "a\u2028b\x85c"}', "", "data: [DONE]"]
    assert json.loads(got[0][len("data: ") :])["t"] == "a\u2028b\x85c"


@pytest.mark.parametrize("method", ["quoka", "quest", "twilight", "kascade", "compact"])
def test_covering_and_real_configs_are_valid_for_every_method(method):
    from vllm_sparse.config import resolve_config

    for cfg in (soak.covering_config(f"sparse_{method}"), soak.real_config(f"sparse_{method}", sparse_prefill=True)):
        resolved = resolve_config(method, None, {"sparse_attention": cfg}, {}).config
        assert resolved.model_reasons(4, 2) == []
        if method == "compact":  # prefill-only: no sparse_decode key at all
            assert "sparse_decode" not in cfg and resolved.compact.engine_reasons(resolved.sparse_decode, 8, 2) == []
    assert soak.covering_config(f"sparse_{method}")["force_sparse"] is True
