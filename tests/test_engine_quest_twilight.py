"""Engine tests: sparse_quest and sparse_twilight inside vLLM on CPU with the small random-weight
Llama (mechanics only). Their page metadata lives in extra head slots (``customize_spec``), so these
engines run with a different page size than dense; chunked prefill (chunks of 100 tokens start
inside 32-token pages), mixed decode/prefill steps and a second batch that hits the prefix cache
(partial pages re-allocated and rewritten from offset 0)."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.engine

GEN_TOKENS = 32
NEAR_TIE = 0.01  # nats: float32 engines, where the two executors' logprobs differ by about 1e-3
NEAR_TIE_TOP = 5  # logprobs kept per position by the runs compared with near-ties allowed


def _prompts() -> list[list[list[int]]]:
    rng = random.Random(4321)
    a, b = ([rng.randrange(0, 256) for _ in range(n)] for n in (900, 1300))
    shares_a = a[:610] + [rng.randrange(0, 256) for _ in range(300)]  # prefix hit, not page aligned
    return [[a, b], [shares_a, a]]


FULL_BUDGET = {"budget": {"fraction": 1.0, "min_tokens": 0}, "dense_layers": [], "dense_below_tokens": 0}
REAL = {
    "budget": {"fraction": 0.25, "min_tokens": 64, "max_tokens": None},
    "sink_tokens": 32,
    "local_tokens": 64,
    "dense_layers": [0],
    "dense_below_tokens": 256,
}
TWILIGHT_REAL = {
    **REAL,
    "budget": {"fraction": 0.5, "min_tokens": 64, "max_tokens": None},
    "twilight": {"top_p": 0.9, "candidate_fraction": 0.3},
}


@pytest.fixture(scope="module")
def engine_results(tiny_llama, run_engines):
    common = {"batches": _prompts(), "max_tokens": GEN_TOKENS}

    def cfg(**kw):
        return {"sparse_attention": kw}

    spec = {
        "model": tiny_llama,
        "runs": [
            {"name": "dense", "backend": "CPU_ATTN", **common},
            {"name": "quest_full", "backend": "sparse_quest", "additional_config": cfg(**FULL_BUDGET), **common},
            {"name": "twilight_full", "backend": "sparse_twilight", "additional_config": cfg(**FULL_BUDGET), **common},
            {
                "name": "quest_sparse",
                "backend": "sparse_quest",
                "additional_config": cfg(**REAL, quest={"gqa_reduce": "union"}),
                **common,
                "logprobs": NEAR_TIE_TOP,
            },
            {
                "name": "twilight_sparse",
                "backend": "sparse_twilight",
                "additional_config": cfg(**TWILIGHT_REAL),
                **common,
                "logprobs": NEAR_TIE_TOP,
            },
            {
                "name": "quest_forced",
                "backend": "sparse_quest",
                "additional_config": cfg(**FULL_BUDGET, force_sparse=True),
                **common,
            },
            {
                "name": "twilight_forced",
                "backend": "sparse_twilight",
                # every candidate, and a top-p that keeps every one of them
                "additional_config": cfg(**FULL_BUDGET, force_sparse=True, twilight={"top_p": 1.0, "candidate_fraction": 1.0}),
                **common,
            },
            {
                "name": "quest_sparse_reference",
                "backend": "sparse_quest",
                "additional_config": cfg(**REAL, quest={"gqa_reduce": "union"}, executor="reference"),
                **common,
                "logprobs": NEAR_TIE_TOP,
            },
            {
                "name": "twilight_sparse_reference",
                "backend": "sparse_twilight",
                "additional_config": cfg(**TWILIGHT_REAL, executor="reference"),
                **common,
                "logprobs": NEAR_TIE_TOP,
            },
        ],
    }
    results, _ = run_engines(spec)
    for name, r in results.items():
        assert r["ok"], f"{name}: {r.get('error')}"
    return results


@pytest.mark.parametrize("name", ["quest_full", "twilight_full"])
def test_budget_covering_context_gives_dense_tokens(engine_results, name):
    dense, full = engine_results["dense"]["tokens"], engine_results[name]["tokens"]
    assert [len(t) for batch in full for t in batch] == [GEN_TOKENS] * 4
    assert full == dense
    first, second = full
    assert second[1] == first[0]  # prompt `a` again, from cached pages
    stats = engine_results[name]["stats"]
    assert stats["steps"] > 0 and stats["attended_pages"] == stats["dense_pages"]


@pytest.mark.parametrize("name", ["quest_sparse", "twilight_sparse"])
def test_real_budget_skips_pages_and_completes(engine_results, name):
    r = engine_results[name]
    assert [len(t) for batch in r["tokens"] for t in batch] == [GEN_TOKENS] * 4
    s = r["stats"]
    assert s["sparse_rows"] > 0
    assert s["attended_pages"] < 0.85 * s["dense_pages"], s



def first_divergences(ref: dict, run: dict) -> list[tuple[int, int, int]]:
    """``(batch, prompt, position)`` of the first differing greedy token of every sequence that differs."""
    out = []
    for b, (batch_ref, batch_run) in enumerate(zip(ref["tokens"], run["tokens"], strict=True)):
        for p, (a, c) in enumerate(zip(batch_ref, batch_run, strict=True)):
            if a != c:
                out.append((b, p, next(i for i, (x, y) in enumerate(zip(a, c)) if x != y)))
    return out


@pytest.mark.parametrize("name", ["quest_sparse", "twilight_sparse"])
def test_fast_executor_gives_the_reference_executors_tokens(engine_results, name):
    """A real budget: vLLM's CPU attention kernel over the rows (``executor: auto``) and the torch
    reference executor pick the same greedy tokens (Twilight's rows differ in length per layer), near-ties
    aside: the two kernels round differently (about 1e-3 in a logprob), so where a sequence parts, the
    reference must rank both tokens within ``NEAR_TIE`` of each other (this random-weight model has such
    ties, and which side a machine's rounding takes depends on its CPU: a flip seen in session 39 had the
    reference's two best at -4.26479 and -4.26489). At most one of the four sequences may part."""
    ref, run = engine_results[f"{name}_reference"], engine_results[name]
    parted = first_divergences(ref, run)
    assert len(parted) <= 1, parted
    for b, p, i in parted:
        tops = ref["top_logprobs"][b][p][i]
        mine, theirs = str(ref["tokens"][b][p][i]), str(run["tokens"][b][p][i])
        assert mine in tops and theirs in tops, (b, p, i, tops)
        assert abs(tops[mine] - tops[theirs]) < NEAR_TIE, (b, p, i, tops)


def test_prefix_cache_hits_happen(engine_results):
    """The second batch reads the shared prefixes from the prefix cache in every run."""
    for name, r in engine_results.items():
        first, second = r["cached"]
        assert first == [0, 0], name
        assert second[0] >= 512 and second[1] >= 800, (name, second)


@pytest.mark.parametrize("name", ["quest", "twilight"])
def test_covering_budget_through_the_selection_path_gives_dense_tokens(engine_results, name):
    """``force_sparse``: every page selected through selector, tables and sparse executor (prefill
    and decode rows), not the dense shortcut; greedy tokens equal dense."""
    r = engine_results[f"{name}_forced"]
    assert r["tokens"] == engine_results["dense"]["tokens"]
    s = r["stats"]
    assert s["sparse_rows"] > 0 and s["attended_pages"] == s["dense_pages"], s
