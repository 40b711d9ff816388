"""The device-driven decode path in a CUDA graph, at Llama-3.1-8B layer shapes (32 query heads, 8 KV
heads, d 128, bf16, pages of 16): captured once with vLLM's capture metadata (every request one
token long), replayed with other lengths, block tables and keys, it gives what an eager run with
those inputs gives, and that equals the torch reference; eager runs make no host sync.

Per method: the K/V and page-metadata write (one launch for a decode step), the selection (scores, top-k or top-p) and the
attention, exactly what a layer's forward launches for a batch of decodes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_skip import no_sync, require_cuda

require_cuda()

from vllm_sparse.config import SparseConfig  # noqa: E402
from vllm_sparse.decode_step import DecodeColumns  # noqa: E402
from vllm_sparse.kernels.decode_attention import decode_attention_reference, decode_attention_triton  # noqa: E402
from vllm_sparse.kernels.kv_write import write_decode_step_triton  # noqa: E402
from vllm_sparse.layout import MetaPlanes, PageLayout  # noqa: E402
from vllm_sparse.metadata.int4_shadow import write_int4_shadow  # noqa: E402
from vllm_sparse.metadata.page_minmax import write_page_minmax  # noqa: E402
from vllm_sparse.selectors import make_selector  # noqa: E402

DEV = "cuda"
HQ, HKV, D, N = 32, 8, 128, 16
MAX_LEN = 32768
B = 4
SCALE = D**-0.5


CONFIGS = {
    "quest": {},
    "quest_sum": {"quest": {"gqa_reduce": "sum"}},
    "twilight": {},
    "quoka_sparse": {"sparse_decode": True},
    "quoka_dense": {},  # QuoKA's default: decodes dense
    "quest_dense_layer": {"dense_layers": [1]},
    "kascade": {"kascade": {"anchors": [0, 1]}},  # layer 1 an anchor: it scores, then selects by its scores
}


class DecodeLayer:
    """One layer's decode work (what ``SparseAttentionImpl`` runs for the decode block) over static
    buffers: the graph reads them at fixed addresses."""

    def __init__(self, name: str, num_blocks: int):
        method = name.split("_")[0]
        self.cfg = SparseConfig(method=method, **CONFIGS[name])
        self.policy = self.cfg.for_layer(1)
        self.selector = make_selector(self.cfg, SCALE)
        if hasattr(self.selector, "for_layer"):  # Kascade: bound to its layer (an anchor here)
            self.selector = self.selector.for_layer(1, 4)
        planes = MetaPlanes.for_method(method, HKV, N, D, torch.bfloat16)
        slots = HKV + (planes.num_slots if planes else 0)
        self.cache = torch.randn(num_blocks, slots, N, 2 * D, device=DEV).bfloat16()
        self.layout = PageLayout.of(self.cache, HKV, "interleaved")
        self.meta = planes.views(self.cache) if planes else None
        self.columns = DecodeColumns([self.policy], N, 16, MAX_LEN, DEV, num_kv_heads=HKV,
                                     anchor_scores=method == "kascade", group_size=HQ // HKV)  # fmt: skip
        self.block_table = torch.zeros(B, MAX_LEN // N, dtype=torch.int32, device=DEV)
        self.query = torch.zeros(B, HQ, D, device=DEV, dtype=torch.bfloat16)
        self.key = torch.zeros(B, HKV, D, device=DEV, dtype=torch.bfloat16)
        self.value = torch.zeros_like(self.key)
        self.slots = torch.full((B,), -1, dtype=torch.int64, device=DEV)
        self.out = torch.zeros(B, HQ, D, device=DEV, dtype=torch.bfloat16)
        self.step = None
        self.last = None

    def set_inputs(self, seq_lens: np.ndarray, g: torch.Generator) -> None:
        """New lengths, block tables, keys and this step's tokens, written into the static buffers."""
        nb = self.cache.shape[0]
        self.block_table.copy_(torch.randint(1, nb, self.block_table.shape, device=DEV, generator=g).int())
        self.query.copy_(torch.randn(self.query.shape, device=DEV, generator=g).bfloat16())
        self.key.copy_(torch.randn(self.key.shape, device=DEV, generator=g).bfloat16())
        self.value.copy_(torch.randn(self.value.shape, device=DEV, generator=g).bfloat16())
        s = torch.as_tensor(seq_lens, device=DEV)
        last = (s - 1).clamp(min=0)
        blocks = self.block_table.long().gather(1, (last // N)[:, None])[:, 0]
        self.slots.copy_(torch.where(s > 0, blocks * N + last % N, -1))
        # keys of the past pages (so that page metadata exists for them), once per input set
        if self.meta is not None:
            for b, n_tok in enumerate(seq_lens.tolist()):
                pos = torch.arange(max(n_tok - 1, 0), device=DEV)
                slots = self.block_table[b, pos // N].long() * N + pos % N
                write_page_minmax(self.layout, self.cache, self.meta, slots)
                if self.meta.codes is not None:
                    keys = self.layout.keys(self.cache)[slots // N, :, slots % N]
                    write_int4_shadow(self.meta, keys, slots, N, self.cache.dtype)
        self.step = self.columns.write(seq_lens, self.block_table)

    def run(self) -> None:
        """The layer's decode forward: KV + metadata write, selection, attention."""
        layout = self.layout
        write_decode_step_triton(layout, self.cache, self.meta, self.key, self.value, self.slots)  # one launch
        step = self.step
        observe = getattr(self.selector, "observe_decode", None)
        if observe is not None:  # Kascade's anchor scores, as the impl runs it before selecting
            observe(self.query, layout.page_keys(self.cache), layout, step)
        if step.selects(self.policy):
            pages, counts = self.selector.select_decode(
                self.query, layout.page_keys(self.cache), layout, self.meta, step, self.policy
            )
        else:  # the step's persistent no-selection buffers, as the impl passes them
            pages, counts = step.no_pages, step.no_counts
        decode_attention_triton(
            self.query, layout.page_keys(self.cache), layout.page_values(self.cache), step.block_table,
            pages, counts, step.columns[self.policy], layout.num_head_slots, SCALE, self.out,
        )  # fmt: skip
        self.last = (pages, counts)

    def reference(self) -> torch.Tensor:
        pages, counts = self.last
        return decode_attention_reference(
            self.query, self.layout.page_keys(self.cache), self.layout.page_values(self.cache),
            self.step.block_table, pages, counts, self.step.columns[self.policy], self.layout.num_head_slots, SCALE,
        )  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_graph_replay_matches_eager_for_any_lengths(name):
    g = torch.Generator(device=DEV).manual_seed(len(name))
    layer = DecodeLayer(name, num_blocks=9000)
    layer.set_inputs(np.ones(B, dtype=np.int64), g)  # vLLM captures with every request one token long
    layer.run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.run()
    captured = layer.last  # the graph's selection buffers (replays rewrite them)
    for seq_lens in ([9000, 3000, 20000, 0], [16000, 17, 5000, 31000], [1, 4097, 0, 0]):
        seq_lens = np.array(seq_lens)
        layer.set_inputs(seq_lens, g)
        cache0 = layer.cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        got, got_sel = layer.out.clone(), [t.clone() for t in captured]
        layer.cache.copy_(cache0)  # the eager run writes this step's token again, identically
        with no_sync():
            layer.run()
        torch.cuda.synchronize()
        assert torch.equal(got, layer.out), (name, seq_lens)
        pages, counts = layer.last
        assert torch.equal(counts, got_sel[1])
        sparse = layer.step.host_columns[layer.policy][:, 0] > 0
        if layer.step.selects(layer.policy) and sparse.any():
            assert int(counts.sum()) > 0
        torch.testing.assert_close(layer.out.float().cpu(), layer.reference(), rtol=2e-2, atol=2e-2)
        for b, s in enumerate(seq_lens):
            if s == 0:
                assert torch.equal(layer.out[b].float(), torch.zeros_like(layer.out[b].float()))


def test_columns_of_steps_written_ahead_of_the_gpu_arrive_intact():
    """The host writes a step's columns while the GPU still runs earlier steps (async scheduling): each
    step's asynchronous copy reads its own staging, never one that a later step has rewritten."""
    cfg = SparseConfig(method="quest")
    policies = [cfg.for_layer(0), cfg.for_layer(1)]
    cols = DecodeColumns(policies, N, 8, MAX_LEN, DEV, num_kv_heads=HKV)
    table = torch.zeros(8, MAX_LEN // N, dtype=torch.int32, device=DEV)
    rng = np.random.default_rng(0)
    steps = [rng.integers(1, MAX_LEN, size=int(rng.integers(1, 9))) for _ in range(12)]
    seen, want = [], []
    for seq in steps:
        torch.cuda._sleep(2_000_000)  # the GPU falls behind the host
        step = cols.write(seq, table)
        seen.append(torch.stack([step.columns[p] for p in policies]).clone())  # runs after the copy, in order
        want.append(np.stack([step.host_columns[p] for p in policies]))
    torch.cuda.synchronize()
    for got, host in zip(seen, want):
        assert np.array_equal(got.cpu().numpy(), host)
