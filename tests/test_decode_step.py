"""Decode columns (policy.decode_columns) and their persistent buffers (decode_step.DecodeColumns):
the vectorised decode plan equals ``plan_request`` row by row, and the buffers keep their address
and zero the rows past the batch (CUDA-graph padding)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_sparse.config import SparseConfig
from vllm_sparse.decode_step import DecodeColumns
from vllm_sparse.policy import HEAD, LAST, PAST, SELECT, TAIL, TOTAL, decode_columns, plan_request, select_cap


@pytest.mark.parametrize("method", ["quoka", "quest", "twilight"])
@pytest.mark.parametrize("force_sparse", [False, True])
@pytest.mark.parametrize("page_size", [16, 32])
def test_decode_columns_equal_plan_request(method, force_sparse, page_size):
    rng = random.Random(repr((method, force_sparse, page_size)))  # str seeds are hashed stably
    for trial in range(6):
        cfg = SparseConfig(
            method=method,
            force_sparse=force_sparse,
            sparse_decode=trial % 3 != 0,
            sink_tokens=rng.choice([0, 16, 40]),
            local_tokens=rng.choice([0, 64, 512]),
            dense_below_tokens=rng.choice([0, 300, 4096]),
            budget={
                "fraction": rng.choice([0.05, 0.125, 0.5]),
                "min_tokens": rng.choice([0, 1024]),
                "max_tokens": rng.choice([None, 16384]),
            },  # fmt: skip
        )
        policy = cfg.for_layer(1 + trial % 2)
        seqs = np.array([0, 1, 2, 17, 33, 100, 1000, 4097, 20000, 131072] + [rng.randint(1, 131072) for _ in range(40)])
        cols = decode_columns(policy, page_size, seqs)
        cap = select_cap(policy, page_size, 131072)
        for s, c in zip(seqs.tolist(), cols):
            if s == 0:
                assert not c.any()
                continue
            r = plan_request(policy, page_size, 0, 1, s)
            head, tail = (r.forced_head, r.forced_tail) if r.sparse else (0, 0)
            want = (r.num_select if r.sparse else 0, head, tail, r.total_pages, s - (r.total_pages - 1) * page_size,
                    r.num_past_pages)  # fmt: skip
            assert tuple(int(c[i]) for i in (SELECT, HEAD, TAIL, TOTAL, LAST, PAST)) == want, (s, policy)
            assert c[SELECT] <= cap
            # the attended pages: selected + [0, HEAD) + [TAIL, TOTAL) = the plan's pages
            assert c[SELECT] + c[HEAD] + c[TOTAL] - c[TAIL] == (r.num_pages if r.sparse else r.total_pages)


def test_buffers_keep_their_address_and_zero_padding_rows():
    policies = [SparseConfig(method="quest").for_layer(i) for i in (0, 1)]  # layer 0 dense, layer 1 sparse
    buf = DecodeColumns(policies, 16, 8, 65536, "cpu")
    table = torch.zeros(8, 4096, dtype=torch.int32)
    first = buf.write(np.array([60000, 5000, 9000]), table)
    addr = {p: first.columns[p].data_ptr() for p in buf.policies}
    assert first.columns[policies[1]][0, SELECT] > 0 and first.columns[policies[0]][0, SELECT] == 0
    second = buf.write(np.array([40000, 0]), table)
    assert {p: second.columns[p].data_ptr() for p in buf.policies} == addr
    full = buf._device  # rows past the batch: zero (a graph captured for more rows attends nothing there)
    assert not full[:, 2:].any() and not full[:, 1].any()
    assert second.block_table.shape[0] == 2 and second.selects(policies[1]) and not second.selects(policies[0])
    with pytest.raises(ValueError, match="exceed"):
        buf.write(np.ones(9, dtype=np.int64), table)


def test_steps_below_the_break_even_decode_dense():
    """A step whose decode rows add up to fewer past tokens than ``min_sparse_tokens`` gets dense
    columns (every page, nothing to select) where the config leaves decode to the method; at or
    above it, the policy's own; configs that ask for sparse decode (or force it) keep selecting;
    the buffers and the captured launches stay the same either way."""
    quest = SparseConfig(method="quest").for_layer(1)
    assert quest.decode_by_cost
    asked = SparseConfig(method="quest", sparse_decode=True).for_layer(1)
    forced = SparseConfig(method="quest", force_sparse=True).for_layer(1)
    assert not asked.decode_by_cost and not forced.decode_by_cost
    assert not SparseConfig(method="quoka").for_layer(1).decode_by_cost
    buf = DecodeColumns([quest, asked, forced], 16, 4, 65536, "cpu", min_sparse_tokens=32768)
    table = torch.zeros(4, 4096, dtype=torch.int32)
    small = buf.write(np.array([16001]), table)  # 16,000 past tokens: below
    c = small.host_columns[quest][0]
    assert c[SELECT] == 0 and c[HEAD] == 0 and c[TAIL] == 0 and c[TOTAL] == -(-16001 // 16)
    assert small.host_columns[forced][0, SELECT] > 0 and small.host_columns[asked][0, SELECT] > 0
    assert small.selects(quest)  # the launches a graph captured do not depend on the step
    big = buf.write(np.array([16385, 16385, 1]), table)  # 2 x 16,384 + 0 past tokens: at the break-even
    assert (big.host_columns[quest][:2, SELECT] > 0).all() and big.host_columns[quest][2, SELECT] == 0
    alone = buf.write(np.array([40001]), table)
    assert alone.host_columns[quest][0, SELECT] > 0
    assert np.array_equal(alone.host_columns[quest], decode_columns(quest, 16, np.array([40001])))
    assert (
        DecodeColumns([quest], 16, 4, 65536, "cpu").write(np.array([16001]), table).host_columns[quest][0, SELECT] > 0
    )


def test_decode_break_even_per_gpu_and_method():
    from vllm_sparse.cost import decode_break_even_tokens

    assert decode_break_even_tokens("quest", "NVIDIA H100 80GB HBM3") == 32768
    assert decode_break_even_tokens("twilight", "NVIDIA H200") == 32768
    assert decode_break_even_tokens("quest", "NVIDIA A100-SXM4-80GB") == 0  # no table: the config decides


def test_a_layer_that_decodes_dense_gets_dense_columns_beside_sparse_layers():
    """``layers: {N: {sparse_decode: false}}``: that layer's policy is its own, its rows attend every page and
    select none, and the layers beside it keep selecting in the same step."""
    cfg = SparseConfig(method="quest", layers={7: {"sparse_decode": False}})
    policies = [cfg.for_layer(i) for i in (6, 7, 8)]
    assert policies[0] == policies[2] != policies[1]
    buf = DecodeColumns(policies, 16, 4, 65536, "cpu")
    step = buf.write(np.array([40001, 20001]), torch.zeros(4, 4096, dtype=torch.int32))
    dense, sparse = step.host_columns[policies[1]], step.host_columns[policies[0]]
    assert not step.selects(policies[1]) and step.selects(policies[0])
    assert (dense[:, SELECT] == 0).all() and (dense[:, HEAD] == 0).all() and (dense[:, TAIL] == 0).all()
    assert (sparse[:, SELECT] > 0).all()
    assert (dense[:, TOTAL] == sparse[:, TOTAL]).all()


def test_column_tables_give_what_decode_columns_computes():
    """``DecodeColumns`` looks a step's columns up in tables made at start (one per policy and its dense
    variant, every length up to ``max_model_len``): the same columns as ``decode_columns`` on random
    batches with padding rows, on both sides of the break-even, and for lengths past the table (computed
    then); a config too large for the tables computes every step."""
    import vllm_sparse.decode_step as ds

    rng = np.random.default_rng(5)
    quest = SparseConfig(method="quest", budget={"fraction": 0.125}).for_layer(1)
    policies = [SparseConfig(method="quest").for_layer(0), quest, SparseConfig(method="quest", sparse_decode=True,
                sink_tokens=40, local_tokens=64).for_layer(1)]  # fmt: skip
    buf = DecodeColumns(policies, 32, 16, 4096, "cpu", min_sparse_tokens=20000)
    assert buf._tables is not None and buf._tables.shape == (2, 3, 4097, 6)
    table = torch.zeros(16, 200, dtype=torch.int32)
    seen_below = seen_above = False
    for trial in range(200):
        seq = rng.integers(0, 4098 if trial % 4 else 4097, size=int(rng.integers(1, 17)))  # 4097: past the table
        seq[rng.random(seq.size) < 0.2] = 0
        below = int(np.maximum(seq - 1, 0).sum()) < 20000
        seen_below, seen_above = seen_below or below, seen_above or not below
        step = buf.write(seq, table)
        for p in policies:
            want = decode_columns(buf._dense[p] if below and p.decode_by_cost else p, 32, seq)
            assert np.array_equal(step.host_columns[p], want), (trial, p)
            assert torch.equal(step.columns[p], torch.from_numpy(want))
        assert not buf._device[:, seq.size :].any()
    assert seen_below and seen_above
    old = ds.TABLE_BYTES
    try:
        ds.TABLE_BYTES = 1000
        small = DecodeColumns(policies, 32, 16, 4096, "cpu")
    finally:
        ds.TABLE_BYTES = old
    assert small._tables is None
    seq = np.array([4000, 0, 17])
    assert np.array_equal(small.write(seq, table).host_columns[quest], decode_columns(quest, 32, seq))
