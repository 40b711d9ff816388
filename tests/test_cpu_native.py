"""Native CPU kernels (csrc/*.cpp) against their torch twins; the loader's fallback.

Twins: ``selectors.quoka.score_pages`` (scoring) and ``torch.topk`` on masked scores (top-k);
``selectors.quest.page_upper_bounds`` / ``page_upper_bounds_rows`` (Quest bounds);
``kernels.anchor_mass.anchor_page_mass`` (Kascade's anchor scoring).
Random, never-zero inputs; page sizes 16 and 32 (and odd ones), D 64 and 128, bf16/fp16/fp32
caches in both in-page orders, 1 to 64 queries, 1 to 3000 pages, non-contiguous page ids; Quest
with GQA groups 1, 2, 7, min/max read from the real metadata planes; the portable (non-AVX-512)
path in a subprocess.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import gen, randn, single_thread  # noqa: F401  (autouse fixture: one torch thread)

from vllm_sparse.config import Budget, LayerPolicy
from vllm_sparse.kernels import cpu_native
from vllm_sparse.kernels.anchor_mass import anchor_page_mass
from vllm_sparse.layout import MetaPlanes, PageLayout
from vllm_sparse.metadata.page_minmax import write_page_minmax
from vllm_sparse.policy import plan_step
from vllm_sparse.selectors import quest, quoka
from vllm_sparse.selectors.quest import QuestSelector, page_upper_bounds, page_upper_bounds_rows
from vllm_sparse.selectors.quoka import group_query, score_pages

HAS_CXX = shutil.which(os.environ.get("CXX") or "c++") is not None
needs_native = pytest.mark.skipif(
    not HAS_CXX or not cpu_native.enabled_by_env(), reason="no C++ compiler, or VLLM_SPARSE_NATIVE=0"
)


@pytest.fixture
def fresh_loader(monkeypatch):
    """A loader that has decided nothing yet; the process's decision is restored afterwards."""
    saved = dict(cpu_native._state)
    cpu_native._state.clear()
    yield
    cpu_native._state.clear()
    cpu_native._state.update(saved)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def sparse_log():
    """Records of the ``vllm_sparse`` logger (attached directly: it may not propagate)."""
    log = logging.getLogger("vllm_sparse")
    h, level = _Records(), log.level
    log.addHandler(h)
    log.setLevel(logging.DEBUG)
    yield h.records
    log.removeHandler(h)
    log.setLevel(level)


def make_case(n, d, dtype, nq, p, hkv=2, order="planes", seed=0):
    """A random cache with spare blocks and shuffled, non-contiguous page ids ``[Hkv, P]``."""
    g = gen(seed + 1000 * n + d + 7 * nq + p)
    slots = hkv + 1  # a metadata-like spare slot: ids are not dense
    nb = p + 3
    kv = randn(nb, slots, n, 2 * d, g=g, dtype=dtype) + 0.1
    layout = PageLayout.of(kv, hkv, order)
    pk = layout.page_keys(kv)
    blocks = torch.randperm(nb, generator=g)[:p]
    ids = layout.page_ids(blocks[None, :], torch.arange(hkv)[:, None])  # [Hkv, P]
    q = randn(nq, hkv * 3, d, g=g) + 0.2
    return group_query(q, hkv), pk, ids


def twin_scores(qbar, pk, ids):
    return score_pages(qbar, pk[ids])


# ---------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("n", [16, 32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nq", [1, 13, 64])
@pytest.mark.parametrize("order", ["planes", "interleaved"])
def test_score_matches_twin(n, d, dtype, nq, order):
    for p in (1, 7, 300):
        qbar, pk, ids = make_case(n, d, dtype, nq, p, order=order)
        torch.testing.assert_close(
            cpu_native.quoka_score(qbar, pk, ids), twin_scores(qbar, pk, ids), rtol=1e-5, atol=1e-5
        )


@needs_native
@pytest.mark.parametrize(
    "n,d,dtype,nq",
    [
        (5, 24, torch.float16, 3),
        (20, 40, torch.bfloat16, 12),
        (48, 64, torch.float32, 25),
        (64, 128, torch.float16, 64),
    ],
)
def test_score_odd_shapes(n, d, dtype, nq):
    """Page sizes that are not a multiple of 16 (masked tails), D not a multiple of 16, fp16."""
    for order in ("planes", "interleaved"):
        qbar, pk, ids = make_case(n, d, dtype, nq, 33, hkv=3, order=order)
        torch.testing.assert_close(
            cpu_native.quoka_score(qbar, pk, ids), twin_scores(qbar, pk, ids), rtol=1e-5, atol=1e-5
        )


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_score_many_pages(threads):
    torch.set_num_threads(threads)  # the autouse fixture restores it
    qbar, pk, ids = make_case(32, 64, torch.bfloat16, 64, 3000)
    torch.testing.assert_close(cpu_native.quoka_score(qbar, pk, ids), twin_scores(qbar, pk, ids), rtol=1e-5, atol=1e-5)


@needs_native
def test_score_noncontiguous_ids_and_int32():
    qbar, pk, ids = make_case(16, 64, torch.bfloat16, 9, 40, hkv=4)
    strided = ids.t().contiguous().t()[:, ::3]  # not contiguous
    assert not strided.is_contiguous()
    want = twin_scores(qbar, pk, strided)
    torch.testing.assert_close(cpu_native.quoka_score(qbar, pk, strided), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_native.quoka_score(qbar, pk, strided.int()), want, rtol=1e-5, atol=1e-5)


@needs_native
def test_score_rejects_bad_ids():
    qbar, pk, ids = make_case(16, 64, torch.float32, 2, 5)
    bad = ids.clone()
    bad[1, 2] = pk.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_native.quoka_score(qbar, pk, bad)


# ---------------------------------------------------------------------------------------------
# top-k (compared by the values selected: ties may pick different but equal pages)
# ---------------------------------------------------------------------------------------------


def assert_same_selection(idx, scores, excluded, k, atol=0.0):
    """``idx [H, k]`` selects the k best non-excluded entries of ``scores`` (by value), no repeats."""
    s = scores.clone()
    if excluded.dtype == torch.bool:
        s[excluded] = float("-inf")
    else:
        s[:, excluded] = float("-inf")
    want = torch.topk(s, k, dim=1).values
    got = torch.gather(s, 1, idx).sort(dim=1, descending=True).values
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    for row in idx:
        assert len(set(row.tolist())) == k


@needs_native
@pytest.mark.parametrize("h,p,k", [(1, 1, 1), (2, 1, 0), (2, 10, 3), (3, 257, 100), (2, 3000, 375), (2, 64, 64)])
@pytest.mark.parametrize("mask", [False, True])
def test_masked_topk_matches_torch(h, p, k, mask):
    g = gen(h * 10000 + p + k)
    scores = randn(h, p, g=g)
    if mask:
        excluded = torch.rand(h, p, generator=g) < 0.2
        excluded[:, p - k :] = False  # at least k candidates per row
    else:
        excluded = torch.randperm(p, generator=g)[: max(0, (p - k) // 2)]
    idx = cpu_native.masked_topk(scores, excluded, k)
    assert idx.shape == (h, k) and idx.dtype == torch.int64
    assert_same_selection(idx, scores, excluded, k)
    if k:  # best first, like torch.topk
        s = torch.gather(scores, 1, idx)
        assert torch.all(s[:, :-1] >= s[:, 1:])


@needs_native
def test_masked_topk_ties_and_nan():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5], [float("nan"), 0.0, 0.0, 3.0, 3.0]])
    idx = cpu_native.masked_topk(scores, torch.tensor([1]), 2)
    assert idx.tolist() == [[2, 3], [0, 3]]  # ties: lower column; NaN ranks first (as torch.topk)


@needs_native
@pytest.mark.parametrize(
    "n,d,dtype,nq,p",
    [
        (32, 64, torch.bfloat16, 64, 1024),
        (16, 128, torch.float32, 1, 500),
        (32, 128, torch.bfloat16, 7, 2000),
        (16, 64, torch.float16, 33, 1),
    ],
)
def test_score_topk_fused(n, d, dtype, nq, p):
    qbar, pk, ids = make_case(n, d, dtype, nq, p)
    forced = torch.cat([torch.arange(min(p, 2)), torch.arange(max(0, p - 5), p)]).unique()
    k = max(0, min(p - forced.numel(), p // 8 + 1))
    idx = cpu_native.quoka_score_topk(qbar, pk, ids, forced, k)
    assert_same_selection(idx, twin_scores(qbar, pk, ids), forced, k, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Quest bounds (kmin/kmax read in place from the metadata planes of a cache)
# ---------------------------------------------------------------------------------------------


def make_planes(n, d, dtype, nb, hkv=2, seed=0):
    """Random ``kmin <= kmax`` written into the metadata planes of a ``planes`` cache; the views."""
    g = gen(seed + 31 * n + d + nb)
    planes = MetaPlanes.for_method("quest", hkv, n, d, dtype)
    kv = randn(nb, hkv + planes.num_slots, n, 2 * d, g=g, dtype=dtype)
    meta = planes.views(kv)
    lo = randn(nb, hkv, d, g=g) - 0.3
    meta.kmin.copy_(lo.to(dtype))
    meta.kmax.copy_((lo + torch.rand(nb, hkv, d, generator=g)).to(dtype))
    assert not meta.kmin.is_contiguous()  # a strided view into the cache
    return meta, g


def twin_bounds(q, meta, blocks):
    return page_upper_bounds(q, meta.kmin[blocks].transpose(0, 1), meta.kmax[blocks].transpose(0, 1))


@needs_native
@pytest.mark.parametrize("n", [16, 32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grp", [1, 2, 7])
def test_quest_bounds_matches_twin(n, d, dtype, grp):
    hkv = 2
    meta, g = make_planes(n, d, dtype, 420, hkv)
    for nq in (1, 13, 64):
        for p in (1, 7, 65, 300):
            blocks = torch.randperm(420, generator=g)[:p]  # shuffled, not dense
            q = randn(nq, hkv * grp, d, g=g, dtype=torch.bfloat16 if nq == 13 else torch.float32) + 0.1
            got = cpu_native.quest_bounds(q, meta.kmin, meta.kmax, blocks)
            assert got.shape == (hkv, grp, p) and got.dtype == torch.float32
            torch.testing.assert_close(got, twin_bounds(q, meta, blocks), rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("nq", [1, 64])
def test_quest_bounds_many_pages(threads, nq):
    torch.set_num_threads(threads)  # the autouse fixture restores it
    meta, g = make_planes(32, 64, torch.bfloat16, 2003)
    blocks = torch.randperm(2003, generator=g)[:2000]
    q = randn(nq, 14, 64, g=g)
    torch.testing.assert_close(
        cpu_native.quest_bounds(q, meta.kmin, meta.kmax, blocks), twin_bounds(q, meta, blocks), rtol=1e-5, atol=1e-4
    )


@needs_native
@pytest.mark.parametrize(
    "n,d,dtype,grp", [(16, 40, torch.float16, 3), (32, 24, torch.bfloat16, 1), (5, 80, torch.float32, 4)]
)
def test_quest_bounds_odd_shapes(n, d, dtype, grp):
    """D not a multiple of 16 (masked channel tails), fp16 planes, 3 KV heads."""
    meta, g = make_planes(n, d, dtype, 90, hkv=3)
    blocks = torch.randperm(90, generator=g)[:77]
    q = randn(9, 3 * grp, d, g=g)
    torch.testing.assert_close(
        cpu_native.quest_bounds(q, meta.kmin, meta.kmax, blocks), twin_bounds(q, meta, blocks), rtol=1e-5, atol=1e-4
    )


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grp", [1, 7])
def test_quest_bounds_rows_matches_twin(dtype, grp):
    hkv = 2
    meta, g = make_planes(32, 64, dtype, 700, hkv)
    for s, p in ((1, 1), (3, 90), (5, 650)):
        blocks = torch.randint(0, 700, (s, p), generator=g)
        q = randn(s, hkv * grp, 64, g=g)
        got = cpu_native.quest_bounds_rows(q, meta.kmin, meta.kmax, blocks)
        assert got.shape == (s * hkv, grp, p)
        torch.testing.assert_close(got, page_upper_bounds_rows(q, meta.kmin, meta.kmax, blocks), rtol=1e-5, atol=1e-4)


@needs_native
def test_quest_bounds_noncontiguous_ids_and_int32():
    meta, g = make_planes(16, 64, torch.bfloat16, 200)
    blocks = torch.randperm(200, generator=g)[:150][::3]
    assert not blocks.is_contiguous()
    q = randn(4, 4, 64, g=g)[:, ::2]  # strided query heads too
    want = twin_bounds(q, meta, blocks)
    torch.testing.assert_close(cpu_native.quest_bounds(q, meta.kmin, meta.kmax, blocks), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        cpu_native.quest_bounds(q, meta.kmin, meta.kmax, blocks.int()), want, rtol=1e-5, atol=1e-4
    )
    rows = torch.stack([blocks, blocks.flip(0)])[:, ::2]
    torch.testing.assert_close(
        cpu_native.quest_bounds_rows(q[:2], meta.kmin, meta.kmax, rows),
        page_upper_bounds_rows(q[:2], meta.kmin, meta.kmax, rows),
        rtol=1e-5,
        atol=1e-4,
    )


@needs_native
def test_quest_bounds_rejects_bad_blocks():
    meta, _ = make_planes(16, 64, torch.float32, 10)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_native.quest_bounds(torch.randn(1, 2, 64), meta.kmin, meta.kmax, torch.tensor([0, 10]))


def quest_case(seq_lens, query_lens, dtype=torch.bfloat16, n=16, d=64, hkv=2, grp=7, seed=0):
    """A cache with written page min/max, a plan (12.5% budget) and the step's queries."""
    g = gen(seed)
    planes = MetaPlanes.for_method("quest", hkv, n, d, dtype)
    pages = [-(-s // n) for s in seq_lens]
    nb = sum(pages) + 4
    kv = randn(nb, hkv + planes.num_slots, n, 2 * d, g=g, dtype=dtype)
    layout, meta = PageLayout.of(kv, hkv, "planes"), planes.views(kv)
    perm = torch.randperm(nb, generator=g)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    start = 0
    for r, p in enumerate(pages):
        table[r, :p] = perm[start : start + p].int()
        start += p
    slots = torch.cat([table[r, torch.arange(s) // n].long() * n + torch.arange(s) % n for r, s in enumerate(seq_lens)])
    write_page_minmax(layout, kv, meta, slots)
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    policy = LayerPolicy(False, Budget(fraction=0.125, min_tokens=0, max_tokens=None), 1, 2, 0)
    plan = plan_step(policy, n, qsl, seq_lens)
    query = randn(qsl[-1], hkv * grp, d, g=g, dtype=dtype)
    return query, layout.page_keys(kv), table, layout, plan, meta


@needs_native
@pytest.mark.parametrize("rule", ["max", "sum", "union"])
def test_quest_selector_takes_the_native_path(monkeypatch, rule):
    calls = []
    for name in ("quest_bounds", "quest_bounds_rows"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    # two decode requests (one batch) and one prefill chunk
    args = quest_case([900, 700, 1200], [1, 1, 40])
    sel = QuestSelector(rule)
    got = sel(*args)
    assert sorted(calls) == ["quest_bounds", "quest_bounds_rows"]
    with cpu_native.torch_path():
        want = sel(*args)
    assert torch.equal(got.counts, want.counts)
    for r in range(got.indices.shape[0]):  # same pages (near-ties aside: none at these sizes)
        k = int(got.counts[r])
        assert set(got.indices[r, :k].tolist()) == set(want.indices[r, :k].tolist())


def test_quest_fallback(monkeypatch, fresh_loader, sparse_log):
    """No library: the selector runs the torch twins, one warning."""
    monkeypatch.setattr(cpu_native, "build", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no C++ compiler")))
    monkeypatch.setattr(cpu_native, "quest_bounds", lambda *a: pytest.fail("native path taken"))
    monkeypatch.setattr(cpu_native, "quest_bounds_rows", lambda *a: pytest.fail("native path taken"))
    args = quest_case([500, 300], [1, 20], dtype=torch.float32)
    query, _, table, _, plan, meta = args
    got = QuestSelector()(*args)
    with cpu_native.torch_path():
        want = QuestSelector()(*args)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.counts, want.counts)
    blocks = table[1, : plan.requests[1].num_past_pages].long()
    q = query[1:21]
    assert torch.equal(quest._bounds(q, meta, blocks), twin_bounds(q, meta, blocks))
    assert len([r for r in sparse_log if r.levelno == logging.WARNING]) == 1


@needs_native
def test_portable_path_matches_twins():
    """The non-AVX-512 loops (``VLLM_SPARSE_NO_AVX512=1``), Quest, QuoKA and Kascade, in a fresh process."""
    script = textwrap.dedent(
        """
        import torch
        from vllm_sparse.kernels import cpu_native
        from vllm_sparse.layout import MetaPlanes
        from vllm_sparse.selectors.quest import page_upper_bounds
        from vllm_sparse.selectors.quoka import score_pages
        ops = cpu_native.load()
        assert ops is not None and not ops.has_avx512(), cpu_native._state
        torch.manual_seed(0)
        for dtype in (torch.bfloat16, torch.float32):
            for d, grp, nq, p in ((64, 7, 1, 70), (128, 2, 33, 130), (40, 1, 5, 3)):
                planes = MetaPlanes.for_method("quest", 2, 16, d, dtype)
                kv = torch.randn(150, 2 + planes.num_slots, 16, 2 * d).to(dtype)
                m = planes.views(kv)
                m.kmin.copy_(torch.randn(150, 2, d) - 0.3)
                m.kmax.copy_(m.kmin.float() + torch.rand(150, 2, d))
                blocks = torch.randperm(150)[:p]
                q = torch.randn(nq, 2 * grp, d)
                want = page_upper_bounds(q, m.kmin[blocks].transpose(0, 1), m.kmax[blocks].transpose(0, 1))
                got = cpu_native.quest_bounds(q, m.kmin, m.kmax, blocks)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
                qbar = torch.nn.functional.normalize(torch.randn(2, nq, d), dim=-1)
                pk = torch.randn(300, 16, d).to(dtype)
                ids = torch.randperm(300)[: 2 * p].view(2, p)
                torch.testing.assert_close(cpu_native.quoka_score(qbar, pk, ids), score_pages(qbar, pk[ids]),
                                           rtol=1e-5, atol=1e-5)
            from vllm_sparse.kernels.anchor_mass import anchor_page_mass
            for c, ctx, n, grp, stride in ((1, 300, 16, 7, 1), (45, 200, 32, 2, 2)):
                q = torch.randn(c, 2 * grp, 64).to(dtype)
                pk = torch.randn(80, n, 64).to(dtype)
                ids = torch.randperm(80)[:2 * 30].view(2, 30)
                want = anchor_page_mass(q, pk, ids, ctx, 0.125, 16, stride)
                got = cpu_native.anchor_page_mass(q, pk, ids, ctx, 0.125, 16, stride)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        print("portable ok")
        """
    )
    env = {**os.environ, "VLLM_SPARSE_NO_AVX512": "1", "VLLM_SPARSE_NATIVE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "portable ok" in proc.stdout


# ---------------------------------------------------------------------------------------------
# Kascade's anchor scoring
# ---------------------------------------------------------------------------------------------


def anchor_case(n, d, dtype, grp, c, ctx, order="planes", hkv=2, seed=0):
    """Queries ``[C, Hkv * grp, D]`` and a paged cache whose pages (shuffled, non-contiguous ids) hold
    every key the chunk's tiles see; peaked scores (some keys aligned with the queries) so that pages differ."""
    g = gen(seed + 31 * n + d + 5 * grp + c + ctx)
    pages = -(-(ctx + c) // n) + 1
    nb = pages + 4
    kv = randn(nb, hkv + 1, n, 2 * d, g=g, dtype=dtype)
    layout = PageLayout.of(kv, hkv, order)
    blocks = torch.randperm(nb, generator=g)[:pages]
    ids = layout.page_ids(blocks[None, :], torch.arange(hkv)[:, None])  # [Hkv, pages]
    q = randn(c, hkv * grp, d, g=g, dtype=dtype) * 2
    return q, layout.page_keys(kv), ids


@needs_native
@pytest.mark.parametrize("n", [16, 32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grp", [1, 4, 7])
@pytest.mark.parametrize("order", ["planes", "interleaved"])
def test_anchor_mass_matches_twin(n, d, dtype, grp, order):
    # decode (one query), a chunk that is not a whole number of tiles, a context ending inside a page,
    # a context shorter than a page (no past page), tile strides
    for c, ctx, tile, stride in ((1, 700, 32, 1), (77, 333, 32, 1), (64, 96, 16, 3), (5, n - 1, 32, 1)):
        q, pk, ids = anchor_case(n, d, dtype, grp, c, ctx, order)
        want = anchor_page_mass(q, pk, ids, ctx, d**-0.5, tile, stride)
        got = cpu_native.anchor_page_mass(q, pk, ids, ctx, d**-0.5, tile, stride)
        assert got.shape == want.shape == (2, ctx // n)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        if got.numel():
            assert float(got.min()) >= 0.0 and float(got.max()) <= 1.0 + 1e-5
        if c == 1 and ctx >= n:  # one tile: a softmax's share over the past pages, at most 1 in all
            assert float(got.sum(1).max()) <= 1.0 + 1e-4


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_anchor_mass_long_context(threads):
    """Many pages and tiles in parallel: the same as the twin, and the same for any thread count."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, pk, ids = anchor_case(32, 64, torch.bfloat16, 7, 300, 5000)
        want = anchor_page_mass(q, pk, ids, 5000, 0.125)
        torch.testing.assert_close(cpu_native.anchor_page_mass(q, pk, ids, 5000, 0.125, 32), want, rtol=1e-4, atol=1e-7)
    finally:
        torch.set_num_threads(old)


@needs_native
def test_anchor_mass_rejects_bad_inputs():
    q, pk, ids = anchor_case(16, 64, torch.float32, 2, 10, 100)
    with pytest.raises(RuntimeError, match="pages per KV head needed"):
        cpu_native.anchor_page_mass(q, pk, ids[:, :3], 100, 0.125, 32)
    bad = ids.clone()
    bad[1, 2] = pk.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_native.anchor_page_mass(q, pk, bad, 100, 0.125, 32)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu_native.anchor_page_mass(q[:, :3], pk, ids, 100, 0.125, 32)


@needs_native
def test_kascade_anchor_takes_the_native_path(monkeypatch):
    """The selector's anchor scoring runs the native kernel on CPUs, with the twin's result."""
    from helpers import make_paged_batch, query_start_loc

    from vllm_sparse.selectors.kascade import score_request

    calls = []
    real = cpu_native.anchor_page_mass
    monkeypatch.setattr(cpu_native, "anchor_page_mass", lambda *a: calls.append(1) or real(*a))
    n, hkv, d, ctx, c = 16, 2, 64, 700, 40
    b = make_paged_batch([ctx + c], hkv, n, d, seed=5)
    layout = PageLayout.of(b.kv_cache, hkv, b.order)
    policy = LayerPolicy(False, Budget(fraction=0.25, min_tokens=0, max_tokens=None), 1, 2, 0)
    req = plan_step(policy, n, query_start_loc([c]), [ctx + c]).requests[0]
    q = randn(c, hkv * 4, d, g=gen(3))
    got = score_request(q, layout.page_keys(b.kv_cache), b.block_table, layout, 0, req, d**-0.5)
    assert calls == [1]
    with cpu_native.torch_path():
        want = score_request(q, layout.page_keys(b.kv_cache), b.block_table, layout, 0, req, d**-0.5)
    assert calls == [1] and got.shape == (hkv, ctx // n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# the selector uses it, and falls back to the torch path
# ---------------------------------------------------------------------------------------------


def _torch_top_pages(qbar, pk, ids, excluded, k):
    s = twin_scores(qbar, pk, ids)
    if excluded.dtype == torch.bool:
        s.masked_fill_(excluded, float("-inf"))
    else:
        s[:, excluded] = float("-inf")
    return torch.topk(s, k, dim=1).indices


@needs_native
def test_selector_takes_the_native_path(monkeypatch):
    calls = []
    real = cpu_native.quoka_score_topk
    monkeypatch.setattr(cpu_native, "quoka_score_topk", lambda *a: calls.append(1) or real(*a))
    qbar, pk, ids = make_case(32, 64, torch.bfloat16, 16, 200)
    forced = torch.tensor([0, 198, 199])
    got = quoka._top_pages(qbar, pk, ids, forced, 20)
    assert calls == [1]
    assert_same_selection(got, twin_scores(qbar, pk, ids), forced, 20, atol=1e-5)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[0, :50] = True
    assert_same_selection(quoka._top_pages(qbar, pk, ids, mask, 20), twin_scores(qbar, pk, ids), mask, 20, atol=1e-5)


def test_fallback_warns_once(monkeypatch, fresh_loader, sparse_log):
    def broken(*a, **k):
        raise RuntimeError("no C++ compiler found (looked for 'c++'; set CXX)")

    monkeypatch.setattr(cpu_native, "build", broken)
    qbar, pk, ids = make_case(16, 64, torch.bfloat16, 5, 60)
    forced = torch.tensor([0, 59])
    for _ in range(3):
        got = quoka._top_pages(qbar, pk, ids, forced, 10)
        assert torch.equal(got, _torch_top_pages(qbar, pk, ids, forced, 10))
        torch.testing.assert_close(quoka._score(qbar, pk, ids), twin_scores(qbar, pk, ids), rtol=0, atol=0)
    warnings = [r for r in sparse_log if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "torch path" in warnings[0].getMessage() and "no C++ compiler" in warnings[0].getMessage()
    assert cpu_native.load() is None and not cpu_native.available()


def test_missing_compiler_reason(monkeypatch, fresh_loader, sparse_log, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-vllm-sparse")
    monkeypatch.setenv("VLLM_SPARSE_CACHE", str(tmp_path))
    assert cpu_native.load() is None
    (w,) = [r for r in sparse_log if r.levelno == logging.WARNING]
    assert "no-such-compiler-vllm-sparse" in w.getMessage()


def test_failed_build_reason(monkeypatch, fresh_loader, sparse_log, tmp_path):
    """A compiler that fails: the warning names the exit status and where the full log is."""
    fake = tmp_path / "badcxx"
    fake.write_text("#!/bin/sh\necho 'fatal error: something broke' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("VLLM_SPARSE_CACHE", str(tmp_path / "cache"))
    assert cpu_native.load() is None
    (w,) = [r for r in sparse_log if r.levelno == logging.WARNING]
    assert "exit 3" in w.getMessage() and "something broke" in w.getMessage()
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-written left behind


def test_env_forces_torch_path(monkeypatch, fresh_loader, sparse_log):
    monkeypatch.setenv("VLLM_SPARSE_NATIVE", "0")
    monkeypatch.setattr(cpu_native, "build", lambda *a, **k: pytest.fail("must not build"))
    qbar, pk, ids = make_case(16, 64, torch.float32, 3, 20)
    assert _torch_top_pages(qbar, pk, ids, torch.tensor([0]), 4).equal(
        quoka._top_pages(qbar, pk, ids, torch.tensor([0]), 4)
    )
    assert not [r for r in sparse_log if r.levelno >= logging.WARNING]


@needs_native
def test_concurrent_builds(tmp_path):
    """Two processes building into one empty cache at once: both load, one library, no temp files."""
    script = textwrap.dedent(
        """
        import torch
        from vllm_sparse.kernels import cpu_native
        ops = cpu_native.load()
        assert ops is not None, cpu_native._state
        q = torch.randn(1, 2, 64); k = torch.randn(4, 16, 64); ids = torch.tensor([[0, 3]])
        print(cpu_native.quoka_score(q, k, ids).shape)
        """
    )
    env = {**os.environ, "VLLM_SPARSE_CACHE": str(tmp_path), "VLLM_SPARSE_NATIVE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        assert "torch.Size([1, 2])" in out
    libs = list(tmp_path.rglob("*.so"))
    assert len(libs) == 1 and libs[0].name == "vllm_sparse_cpu.so"
    assert not [f for f in libs[0].parent.iterdir() if f.name.startswith(".")]


@needs_native
@pytest.mark.parametrize("method", ["quest", "twilight"])  # twilight: min/max beside its INT4 planes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["decode", "chunk", "padded"])
def test_page_minmax_write_equals_the_torch_writer(method, dtype, kind):
    """The native page summaries (min/max and their INT8 codes) equal the torch writer's, bit for bit, on a
    decode step (one slot per page: a fresh page at offset 0, a middle one, a full one), a chunk writing many
    slots of a page (the last offset counts, in any order), and padding slots; pages not written keep theirs."""
    hkv, n, d, nb = 2, 16, 64, 12
    planes = MetaPlanes.for_method(method, hkv, n, d, dtype)
    cache = randn(nb, hkv + planes.num_slots, n, 2 * d, g=gen(7), dtype=dtype)
    layout = PageLayout.of(cache, hkv, "planes")
    slots = {
        "decode": [3 * n + 0, 5 * n + 7, 9 * n + n - 1],
        "chunk": [2 * n + 4, 2 * n + 9, 2 * n + 1, 6 * n + 0, 7 * n + 15, 7 * n + 3],
        "padded": [-1, 4 * n + 5, -1, 10 * n + 0],
    }[kind]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    want_cache, got_cache = cache.clone(), cache.clone()
    with cpu_native.torch_path():
        write_page_minmax(layout, want_cache, planes.views(want_cache), slot_mapping)
    meta = planes.views(got_cache)
    assert cpu_native.page_minmax_write(layout.keys(got_cache), slot_mapping, meta)
    written = torch.tensor(sorted({s // n for s in slots if s >= 0}))
    assert not torch.equal(meta.kmin[written], planes.views(cache).kmin[written])  # it wrote
    # planes, codes, scales written as the torch writer writes them; the rest of the cache untouched
    torch.testing.assert_close(got_cache, want_cache, rtol=0, atol=0, equal_nan=True)
    assert meta.kmin8 is not None  # the INT8 codes were compared too
    # and through the writer's own dispatch (native where it applies)
    via = cache.clone()
    write_page_minmax(layout, via, planes.views(via), slot_mapping)
    torch.testing.assert_close(via, want_cache, rtol=0, atol=0, equal_nan=True)


@needs_native
def test_page_minmax_write_declines_planes_of_another_dtype():
    hkv, n, d = 2, 16, 64
    planes = MetaPlanes.for_method("quest", hkv, n, d, torch.float32)
    cache = randn(4, hkv + planes.num_slots, n, 2 * d, g=gen(8), dtype=torch.float32)
    layout = PageLayout.of(cache, hkv, "planes")
    meta = planes.views(cache)
    keys = layout.keys(cache).to(torch.bfloat16)
    assert not cpu_native.page_minmax_write(keys, torch.tensor([5]), meta)
