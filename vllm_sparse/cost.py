"""When a sparse prefill chunk pays: a per-layer time model, fitted on measurements of one GPU kind.

A chunk of ``q`` queries after ``ctx`` past tokens costs, per layer, dense (vLLM's FlashAttention,
what the backend runs for dense chunks) and sparse (selection, tables, the sparse executor over
``kept`` past tokens plus the chunk itself)::

    dense(q, ctx)        = a * q * (ctx + q / 2)
    sparse(q, ctx, kept) = b * q * (kept + q / 2) + c * s * ctx + e * q + f

``s`` is the number of queries that score pages (the method's scoring queries: Quest every query
of the chunk or its window, QuoKA its ``num_queries``, Twilight its window). Times in microseconds
with pair counts in millions. The coefficients come from ``benchmarks/step_breakdown_gpu.py`` on
the GPU named in the table, fitted by ``benchmarks/fit_prefill_cost.py``; a GPU without a table
gets no model, and the thresholds of the config decide alone (``policy.plan_request``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_sparse.config import SparseConfig


@dataclass(frozen=True)
class PrefillCost:
    """Fitted per-layer time model of one method on one GPU kind (see the module docstring)."""

    dense_a: float  # us per million query-key pairs, dense FlashAttention
    attend_b: float  # us per million query-key pairs, the sparse executor
    score_c: float  # us per million (scoring query, past token) pairs, the selection
    per_query_e: float  # us per thousand queries (query subselection, regrouping)
    fixed_f: float  # us per layer call (launches, tables)
    scoring_queries: int | None = None  # None: every query of the chunk

    def dense_us(self, q: int, ctx: int) -> float:
        return self.dense_a * q * (ctx + q / 2) / 1e6

    def sparse_us(self, q: int, ctx: int, kept: int) -> float:
        s = q if self.scoring_queries is None else min(q, self.scoring_queries)
        return (
            self.attend_b * q * (kept + q / 2) / 1e6
            + self.score_c * s * ctx / 1e6
            + self.per_query_e * q / 1e3
            + self.fixed_f
        )

    def sparse_pays(self, q: int, ctx: int, kept: int) -> bool:
        return self.sparse_us(q, ctx, kept) < self.dense_us(q, ctx)


#: (GPU family, method) -> (dense_a, attend_b, score_c, per_query_e, fixed_f), from
#: benchmarks/results/step_breakdown_h100_flash_rows/step_breakdown_gpu.json (fit_prefill_cost.py).
#: Measured on an H100 80GB HBM3 (vLLM 0.33's FA3 for dense chunks and for the sparse rows,
#: Triton 3.6), Llama-3.1-8B layer shapes, shipped defaults at 12.5%; each fit is within about 20%
#: of every measured point. ``fixed_f`` is mostly the host's launch time of the selection.
COEFFICIENTS: dict[tuple[str, str], tuple[float, float, float, float, float]] = {
    ("hopper", "quest"): (25.4773, 34.5099, 1.4644, 0.0000, 404.6),
    ("hopper", "quoka"): (25.4773, 25.3204, 0.0000, 34.0694, 1022.6),
    ("hopper", "twilight"): (25.4773, 28.4140, 70.9628, 0.0000, 1275.7),
}

#: GPU names (``torch.cuda.get_device_name``) -> the family whose table they use.
FAMILIES = {"H100": "hopper", "H200": "hopper", "H800": "hopper", "H20": "hopper", "GH200": "hopper"}


def cost_method(config: SparseConfig) -> str:
    """The method whose fitted prefill model applies to ``config``'s prefill chunks: Quest ranking
    its chunks' pages by QuoKA's exact scores (``quest.prefill_scores: exact``) runs QuoKA's
    selection and the same executor; Twilight's chunks, unpruned (``twilight.prune_prefill`` off),
    run its candidate selector alone."""
    method = config.method
    if method == "twilight" and not config.twilight.prune_prefill:
        method = config.twilight.candidates
    if method == "quest" and config.quest_prefill_scores() == "exact":
        return "quoka"
    return method


def scoring_queries(config: SparseConfig) -> int | None:
    """The queries of a chunk that score past pages under ``config`` (None: all of them)."""
    if cost_method(config) == "quoka":
        return config.quoka.num_queries
    return config.query_window()


def prefill_cost(config: SparseConfig, device_name: str) -> PrefillCost | None:
    """The fitted model of ``config.method`` on the GPU ``device_name``; None without a table."""
    family = next((f for key, f in FAMILIES.items() if key in device_name.upper()), None)
    coeffs = COEFFICIENTS.get((family, cost_method(config))) if family else None
    if coeffs is None:
        return None
    return PrefillCost(*coeffs, scoring_queries=scoring_queries(config))


#: (GPU family, method) -> past tokens that a step's decode rows must add up to before their
#: selection pays. Per layer on an H100 (``benchmarks/results/decode_kernels_h100_session7``,
#: Llama-3.1-8B shapes, 12.5%): dense rows cost about 0.0028 ms per thousand past tokens of the
#: step; the sparse layer costs a fixed 0.035-0.063 ms (selection launches and their latency) plus
#: 0.0005-0.0012 ms per thousand, so the lines cross at 15K (Quest), 26K (QuoKA) and 28K
#: (Twilight) past tokens. One 16K request decoding alone measured 1.14x (Quest) and 1.23x
#: (Twilight) FLASH_ATTN's TPOT sparse in ``vllm serve`` (load C of ``serve_bench``), so every
#: method's threshold is rounded up to 32K: one request of 16K decodes dense, two of them or one of
#: 32K sparse.
DECODE_BREAK_EVEN_TOKENS: dict[tuple[str, str], int] = {
    ("hopper", "quest"): 32768,
    ("hopper", "quoka"): 32768,
    ("hopper", "twilight"): 32768,
}


def decode_break_even_tokens(method: str, device_name: str) -> int:
    """Past tokens a step's decode rows must add up to for ``method``'s sparse decode to pay on the
    GPU ``device_name`` (0: no table, the config's thresholds decide alone)."""
    family = next((f for key, f in FAMILIES.items() if key in device_name.upper()), None)
    return DECODE_BREAK_EVEN_TOKENS.get((family, method), 0) if family else 0
