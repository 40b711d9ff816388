"""The attention-recall measure (``vllm_sparse/eval/recall*.py``) on synthetic queries and keys, and the
capture on the tiny random-weight model: no download, a few seconds."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vllm_sparse.config import parse_config
from vllm_sparse.eval.recall import PageMass, covered, dense_page_mass, needle_coverage, needle_mass, oracle_pages
from vllm_sparse.eval.recall_run import AnchorMasses, measure_layer
from vllm_sparse.eval.recall_select import anchor_mass, select

N, HQ, HKV, D = 16, 4, 2, 16
SCALE = D**-0.5
BASE = {"sink_tokens": 16, "local_tokens": 64, "dense_layers": [0], "dense_below_tokens": 0,
        "budget": {"fraction": 0.25, "min_tokens": 0}, "quoka": {"num_queries": 8}}  # fmt: skip


def _qk(seq: int, queries: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [queries, HQ, D]`` and ``k [seq, HKV, D]`` with a few keys that attract attention."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(seq, HKV, D, generator=g)
    q = torch.randn(queries, HQ, D, generator=g)
    hot = torch.randint(0, seq - 100, (12,), generator=g)
    k[hot] += 3 * q[:, ::2].mean(dim=0)  # keys aligned with the queries of each group's first head
    return q, k


def _config(method: str, **fields):
    data = {**BASE, **fields}
    return parse_config(data, method, "test")


def test_dense_mass_sums_to_one_per_query_head():
    q, k = _qk(600, 40)
    mass = dense_page_mass(q, k, num_past=560 // N, page_size=N, scale=SCALE)
    assert mass.past.shape == (HKV, HQ // HKV, 560 // N)
    torch.testing.assert_close(mass.past.sum(-1) + mass.rest, torch.ones(HKV, HQ // HKV))
    everything = torch.arange(560 // N)
    torch.testing.assert_close(covered(mass, everything, [torch.zeros(0, dtype=torch.int64)] * HKV),
                               torch.ones(HKV, HQ // HKV))  # fmt: skip
    # one query: the exact softmax by hand
    w = torch.softmax(torch.einsum("hd,shd->hs", q[-1], k.repeat_interleave(2, dim=1)) * SCALE, dim=-1)
    one = dense_page_mass(q[-1:], k, num_past=10, page_size=N, scale=SCALE)
    torch.testing.assert_close(one.past.reshape(HQ, 10), w[:, :160].reshape(HQ, 10, N).sum(-1))


@pytest.mark.parametrize("method", ["quest", "quoka", "twilight", "compact", "kascade"])
@pytest.mark.parametrize("queries", [1, 48])
def test_oracle_bounds_every_selector(method, queries):
    seq = 1000
    q, k = _qk(seq, queries, seed=queries)
    config = _config(method)
    choice = select(config, 3, q, k, N, SCALE)
    assert choice.plan.sparse and choice.plan.num_select > 0
    counts = [int(s.numel()) for s in choice.selected]
    forced = set(choice.forced_past.tolist())
    for sel in choice.selected:
        assert not forced & set(sel.tolist()) and len(set(sel.tolist())) == sel.numel()
    # fixed counts (Twilight prunes decode steps only, compact keeps what its threshold keeps)
    if method in ("quest", "quoka", "kascade") or (method == "twilight" and queries > 1):
        assert counts == [choice.plan.num_select] * HKV
    mass = dense_page_mass(q, k, choice.plan.num_past_pages, N, SCALE)
    got = covered(mass, choice.forced_past, choice.selected)
    best = covered(mass, choice.forced_past, oracle_pages(mass, choice.forced_past, counts))
    assert (best.mean(dim=1) >= got.mean(dim=1) - 1e-6).all()  # the group mean is what the oracle maximises
    assert 0.0 < got.min() and got.max() <= 1.0 + 1e-6


@pytest.mark.parametrize("method", ["quest", "quoka", "twilight", "compact", "kascade"])
def test_full_budget_covers_everything(method):
    q, k = _qk(800, 16)
    full = {"budget": {"fraction": 1.0, "min_tokens": 0, "max_tokens": None},
            "twilight": {"top_p": 1.0, "candidate_fraction": 1.0}, "compact": {"block_threshold": 0.0}}  # fmt: skip
    for fields in (full, {**full, "force_sparse": True}):  # dense shortcut, then the selection path
        choice = select(_config(method, **fields), 2, q, k, N, SCALE)
        assert choice.plan.sparse == (bool(fields.get("force_sparse")) or method == "compact")  # compact: no budget
        mass = dense_page_mass(q, k, choice.plan.num_past_pages, N, SCALE)
        torch.testing.assert_close(covered(mass, choice.forced_past, choice.selected), torch.ones(HKV, HQ // HKV))


@pytest.mark.parametrize("seq,queries", [(1200, 100), (1210, 100), (1000, 1)])
def test_compact_pages_are_the_engine_selectors(seq, queries):
    """The measure's compact pages are ``CompactSelector``'s row for the same keys (paged in a
    shuffled cache) and queries, with two blocks per KV head planted so that the threshold drops the
    others (the test can fail)."""
    from helpers import make_paged_batch

    from vllm_sparse.layout import PageLayout
    from vllm_sparse.policy import plan_step
    from vllm_sparse.selectors import make_selector

    config = _config("compact", compact={"block_threshold": 0.3, "block_pages": 2, "tile": 32})
    b = make_paged_batch([seq], HKV, N, D, seed=seq)
    layout = PageLayout.of(b.kv_cache, HKV, b.order)
    g = torch.Generator().manual_seed(seq)
    q = torch.randn(queries, HQ, D, generator=g)
    direction = torch.nn.functional.normalize(torch.randn(HKV, D, generator=g), dim=1)
    cache_keys = layout.keys(b.kv_cache)
    for h, blocks in {0: (3, 11), 1: (6, 20)}.items():  # blocks of 2 pages
        for p in (p for blk in blocks for p in (2 * blk, 2 * blk + 1)):
            cache_keys[int(b.block_table[0, p]), h] += 8 * direction[h]
            b.keys[0][p * N : (p + 1) * N, h] += 8 * direction[h]
        q[:, h * (HQ // HKV) : (h + 1) * (HQ // HKV)] += 4 * direction[h]
    keys = b.keys[0]  # [S, Hkv, D]
    choice = select(config, 1, q, keys, N, SCALE)
    policy = dataclasses.replace(config.for_layer(1), sparse_decode=True)  # as the measure plans every step
    plan = plan_step(policy, N, [0, queries], [seq])
    sel = make_selector(config, SCALE)(q, layout.page_keys(b.kv_cache), b.block_table, layout, plan)
    dropped = 0
    for h in range(HKV):
        row = sel.indices[h, : int(sel.counts[h])]
        assert row.tolist() == sorted(choice.selected[h].tolist()), h
        dropped += choice.plan.num_past_pages - choice.forced_past.numel() - row.numel()
    assert dropped > 0


@pytest.mark.parametrize("seq,queries,window", [(1200, 100, None), (1210, 100, 24), (1000, 1, None), (1000, 1, 24)])
def test_kascade_pages_are_the_engine_selectors(seq, queries, window):
    """The measure's Kascade pages are ``KascadeSelector``'s rows for the same keys (paged in a
    shuffled cache) and queries: at anchor layer 2 (its own queries and keys), and at reuse layer 3
    (head map ``[1, 0]``) from the anchor's mass; a chunk (starting inside a page) and a decode step,
    with and without ``chunk_query_window``."""
    from helpers import make_paged_batch

    from vllm_sparse.layout import PageLayout
    from vllm_sparse.policy import plan_step
    from vllm_sparse.selectors import make_selector

    config = _config("kascade", kascade={"anchors": [0, 2], "head_map": {3: [1, 0]}, "tile": 8},
                     chunk_query_window=window or 0)  # fmt: skip
    b = make_paged_batch([seq], HKV, N, D, seed=seq)
    layout = PageLayout.of(b.kv_cache, HKV, b.order)
    page_keys = layout.page_keys(b.kv_cache)
    q = torch.randn(queries, HQ, D, generator=torch.Generator().manual_seed(seq))
    keys = b.keys[0]  # [S, Hkv, D]
    policy = dataclasses.replace(config.for_layer(2), sparse_decode=True)  # as the measure plans every step
    plan = plan_step(policy, N, [0, queries], [seq])
    base = make_selector(config, SCALE)
    anchor, reuse = base.for_layer(2, 5), base.for_layer(3, 5)
    anchor.observe(q, page_keys, b.block_table, layout, plan)
    reuse.observe(q, page_keys, b.block_table, layout, plan)
    mass = anchor_mass(config, q, keys, N, SCALE)
    for layer, sel, given in ((2, anchor, None), (3, reuse, mass)):
        choice = select(config, layer, q, keys, N, SCALE, given)
        assert choice.plan.sparse and choice.plan.num_select > 0
        engine = sel(q, page_keys, b.block_table, layout, plan)
        for h in range(HKV):
            row = engine.indices[h, : int(engine.counts[h])]
            assert sorted(row.tolist()) == sorted(choice.selected[h].tolist()), (layer, h)
    if window and queries > window:  # (the window changes the pages: the test can fail)
        whole = select(config.model_copy(update={"chunk_query_window": 0}), 2, q, keys, N, SCALE)
        assert any(set(a.tolist()) != set(w.tolist()) for a, w in zip(choice.selected, whole.selected, strict=True))


def test_kascade_reuse_layer_reads_its_anchor_through_the_head_map():
    """A reuse layer's pages come from its anchor's queries and keys, not its own: random queries and
    keys of layers 3 and 4 leave them unchanged, layer 3's swapped head map swaps the KV heads' rows;
    ``AnchorMasses`` computes each anchor's mass once, from the anchor layer's inputs."""
    config = _config("kascade", kascade={"anchors": [0, 2], "head_map": {3: [1, 0]}})
    inputs = {layer: {"prefill": _qk(1000, 48, seed=layer), "decode": _qk(1000, 1, seed=10 + layer)}
              for layer in range(5)}  # fmt: skip
    calls = []
    anchors = AnchorMasses(lambda layer: calls.append(layer) or inputs[layer], 5, N, SCALE)
    assert [anchors.anchor_layer(config, layer) for layer in range(5)] == [0, 0, 2, 2, 2]
    for step in ("prefill", "decode"):
        own = select(config, 2, *inputs[2][step], N, SCALE)  # anchor layer 2: its own queries and keys
        assert anchors(config, 4, step) is anchors(config, 3, step) is anchors(config, 2, step)
        identity = select(config, 4, *inputs[4][step], N, SCALE, anchors(config, 4, step))
        swapped = select(config, 3, *inputs[3][step], N, SCALE, anchors(config, 3, step))
        for h in range(HKV):
            assert identity.selected[h].tolist() == own.selected[h].tolist()
            assert swapped.selected[h].tolist() == own.selected[1 - h].tolist()
        alone = select(config, 4, *inputs[4][step], N, SCALE)  # layer 4 as if an anchor: other pages
        assert any(set(a.tolist()) != set(o.tolist()) for a, o in zip(alone.selected, own.selected, strict=True))
    assert calls == [2, 2]  # one read of layer 2's inputs per step, none of layers 3 and 4
    configs = {(0.25, "kascade"): config}
    steps = {"decode": (*inputs[3]["decode"], {"decode": dense_page_mass(*inputs[3]["decode"], 1000 // N, N, SCALE)})}
    with pytest.raises(ValueError, match="anchor"):
        measure_layer(configs, 3, steps, torch.tensor([5]), N, SCALE)
    (rec,) = measure_layer(configs, 3, steps, torch.tensor([5]), N, SCALE, anchors)
    assert rec["selected_pages"] == [swapped.plan.num_select] * HKV and rec["oracle"] >= rec["recall"] - 1e-6


def test_needle_coverage():
    forced = torch.tensor([0, 9])
    assert needle_coverage(torch.tensor([3, 4]), forced, [torch.tensor([3, 4]), torch.tensor([3])], 10) == [1.0, 0.5]
    assert needle_coverage(torch.tensor([12]), forced, [torch.tensor([1])], 10) is None  # the step's own page
    assert needle_coverage(torch.tensor([3, 12]), forced, [torch.tensor([1])], 10) == [0.0]
    past = torch.zeros(2, 2, 10)
    past[0, :, 3], past[0, :, 4], past[1, 0, 4] = 0.2, 0.1, 0.4  # head 1's second query head: nothing
    mass = PageMass(past, torch.zeros(2, 2))
    total, got = needle_mass(mass, torch.tensor([3, 4, 12]), forced, [torch.tensor([3]), torch.tensor([3])])
    assert total == pytest.approx([0.3, 0.2]) and got == pytest.approx([0.2, 0.0])


def test_measure_layer_records(tmp_path):
    q, k = _qk(900, 33)
    configs = {(b, m): _config(m, budget={"fraction": b, "min_tokens": 0}) for b in (0.125, 0.25)
               for m in ("quest", "quoka")}  # fmt: skip
    cq, ck = q[:-1], k[:-1]
    start = 899 - 32
    steps = {
        "prefill": (cq, ck, {"prefill": dense_page_mass(cq, ck, start // N, N, SCALE),
                             "prefill_last": dense_page_mass(cq[-1:], ck, start // N, N, SCALE)}),
        "decode": (q[-1:], k, {"decode": dense_page_mass(q[-1:], k, 900 // N, N, SCALE)}),
    }  # fmt: skip
    recs = measure_layer(configs, 0, steps, torch.tensor([5, 6]), N, SCALE)
    assert len(recs) == 4 * 3
    for r in recs:
        assert r["oracle"] >= r["recall"] - 1e-6 and r["oracle_selectable"] >= r["selectable"] - 1e-6
        assert r["dense_layer"] and r["engine_dense"]  # layer 0 is a dense layer of BASE
        assert len(r["recall_heads"]) == HKV and len(r["recall_heads"][0]) == HQ // HKV
    # the summary, tables and plot of a run made of these records (layer 0 measured as layer 1 too)
    from vllm_sparse.eval.recall_report import summarize, write_outputs

    records = [{"prompt": 0, "context": 1024, **r, "layer": lyr, "dense_layer": lyr == 0, "engine_dense": lyr == 0}
               for lyr in (0, 1)
               for r in recs]  # fmt: skip
    result = {"command": "test", "model": "synthetic", "prompts": [{"task": "t", "context": 1024, "depth": 0.5}],
              "sparse_config": {"file": "x.yaml", "fields": BASE}, "config": {"variants": {}},
              "summary": summarize(records), "records": records}  # fmt: skip
    assert len(result["summary"]) == 3 * 2 * 2  # phase x budget x method, layer 1 only
    assert all(s["needle_kept"] <= 1.0 + 1e-6 for s in result["summary"] if s["needle_kept"] is not None)
    files = write_outputs(result, tmp_path)
    assert "| decode | 0.25 | quest |" in (tmp_path / "tables.md").read_text()
    assert (tmp_path / "recall_per_layer_1k.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "recall.json").read_text())["records"] == records and len(files) == 3
    small = [r["recall"] for r in recs if r["budget"] == 0.125 and r["phase"] == "decode"]
    large = [r["recall"] for r in recs if r["budget"] == 0.25 and r["phase"] == "decode"]
    assert min(large) >= max(0.0, min(small) - 1e-6)


def test_capture_chunked_equals_whole(tiny_llama):
    """Chunked prefill (a cache, a mask with a query offset) gives the keys and queries of one pass."""
    from vllm_sparse.eval.capture import capture, load_model

    model, tok = load_model(tiny_llama, torch.float32)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 6, add_special_tokens=False)
    whole = capture(model, ids, keep_from=100, chunk_size=4096, cache_dtype=torch.float32, progress=False)
    chunked = capture(model, ids, keep_from=100, chunk_size=64, cache_dtype=torch.float32, progress=False)
    assert len(whole.keys) == model.config.num_hidden_layers
    assert whole.keys[0].shape == (len(ids) + 1, model.config.num_key_value_heads, 64)
    assert whole.queries[0].shape == (len(ids) + 1 - 100, model.config.num_attention_heads, 64)
    assert whole.decode_token == chunked.decode_token
    for a, b in zip(whole.keys + whole.queries, chunked.keys + chunked.queries, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_capture_decode_steps_follow_the_greedy_answer(tiny_llama):
    """``decode_steps`` feeds back each greedy token: the keys and queries at the decode positions are
    those of one pass over the prompt plus the answer so far, and the tokens those of greedy decoding."""
    from vllm_sparse.eval.capture import capture, load_model

    model, tok = load_model(tiny_llama, torch.float32)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 6, add_special_tokens=False)
    t = len(ids)
    steps = capture(model, ids, keep_from=100, chunk_size=64, cache_dtype=torch.float32, progress=False,
                    decode_steps=4)  # fmt: skip
    assert len(steps.decode_tokens) == 4 and steps.decode_token == steps.decode_tokens[0]
    assert steps.keys[0].shape[0] == t + 4 and steps.queries[0].shape[0] == t + 4 - 100
    # one pass over prompt + the first three answer tokens, then its own decode step: the same tensors
    once = capture(model, ids + steps.decode_tokens[:3], keep_from=100, chunk_size=4096, cache_dtype=torch.float32,
                   progress=False)  # fmt: skip
    assert once.decode_token == steps.decode_tokens[3]
    for a, b in zip(steps.keys + steps.queries, once.keys + once.queries, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, t:].tolist()
    assert steps.decode_tokens == greedy
    with pytest.raises(ValueError, match="decode_steps"):
        capture(model, ids, keep_from=100, decode_steps=0, progress=False)


def test_step_inputs_and_records_of_later_decode_steps():
    """``step_inputs`` gives each captured decode token its own step (``decode``, ``decode+1``, ...) over
    the keys up to it; their records carry the step, and the engine decodes them dense where a layer's
    ``sparse_decode`` is off, as for the first decode token."""
    from types import SimpleNamespace

    from vllm_sparse.eval.recall_run import step_inputs

    t, start, extra = 900, 896, 3
    q, k = _qk(t + extra, t + extra - start)
    cap = SimpleNamespace(queries=[q], keys=[k])
    got = step_inputs(cap, 0, t=t, start=start)
    assert list(got) == ["prefill", "decode", "decode+1", "decode+2"]
    assert got["prefill"][0].shape[0] == t - start and got["prefill"][1].shape[0] == t
    for j, name in enumerate(["decode", "decode+1", "decode+2"]):
        dq, dk = got[name]
        assert dq.shape[0] == 1 and dk.shape[0] == t + j + 1
        torch.testing.assert_close(dq, q[t - start + j : t - start + j + 1])
    configs = {(0.25, "quest"): _config("quest", layers={1: {"sparse_decode": False}})}
    dq, dk = got["decode+2"]
    steps = {"decode+2": (dq, dk, {"decode_answer": dense_page_mass(dq, dk, (t + 2) // N, N, SCALE)})}
    (sparse,) = measure_layer(configs, 2, steps, torch.tensor([5]), N, SCALE)
    (dense,) = measure_layer(configs, 1, steps, torch.tensor([5]), N, SCALE)
    assert (sparse["phase"], sparse["step"], sparse["engine_dense"]) == ("decode_answer", "decode+2", False)
    assert dense["engine_dense"] and sparse["past_pages"] == (t + 2) // N
