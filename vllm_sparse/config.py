"""Selector configuration: pydantic models, YAML loading, and where the config comes from.

Sources, first match wins (README "Configuration"):
  1. ``--additional-config '{"sparse_attention": {...}}'`` (inline fields, or ``{"config": PATH}``
     plus optional inline fields that override the file's);
  2. the environment variable ``SPARSE_ATTENTION_CONFIG`` (a path to a YAML file);
  3. a shipped YAML from ``configs/`` (installed as ``vllm_sparse.configs``) matched on the model's hub
     name or path, case-insensitively (``match_shipped_config``: file name, then the ``models`` list);
  4. the method defaults below.
The method itself comes from the backend name (``sparse_quoka`` -> ``quoka``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationError,
    model_validator,
)

from vllm_sparse.resources import data_dir

METHODS = ("quoka", "quest", "twilight", "kascade", "compact")
Method = Literal["quoka", "quest", "twilight", "kascade", "compact"]
ENV_VAR = "SPARSE_ATTENTION_CONFIG"
ADDITIONAL_CONFIG_KEY = "sparse_attention"
SHIPPED_DIR = data_dir("configs")


class SparseConfigError(ValueError):
    """An invalid selector config; the message lists every bad field at once."""

    def __init__(self, source: str, reasons: list[str]):
        self.source = source
        self.reasons = reasons
        lines = "\n".join(f"  - {r}" for r in reasons)
        super().__init__(f"invalid sparse attention config ({source}):\n{lines}")


MAX_INT = 2**31 - 1  # token counts, layers and heads past this are typos (and overflow int32 tables)


def _not_bool_or_str(value: Any) -> Any:
    """Numbers only: pydantic's lax mode would read ``true`` as 1 and ``"16"`` as 16."""
    if isinstance(value, (bool, str)):
        raise ValueError(f"must be a number, not {type(value).__name__} {value!r}")
    return value


Int = Annotated[int, BeforeValidator(_not_bool_or_str), Field(le=MAX_INT)]
Index = Annotated[Int, Field(ge=0)]  # a layer or a KV head; whether the model has it is checked at start
Float = Annotated[float, BeforeValidator(_not_bool_or_str)]
Bool = Annotated[bool, Strict()]  # true or false, not 1, "yes" or "on"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Budget(_Strict):
    """Past-context tokens attended per (request, KV head): clamp(fraction * context, min, max)."""

    fraction: Float = Field(0.125, gt=0.0, le=1.0)
    min_tokens: Int = Field(1024, ge=0)
    max_tokens: Int | None = Field(16384, ge=1)

    @model_validator(mode="after")
    def _min_below_max(self) -> Budget:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    def tokens(self, context_len: int) -> int:
        want = max(int(self.fraction * context_len), self.min_tokens)
        return want if self.max_tokens is None else min(want, self.max_tokens)


class QuokaOptions(_Strict):
    num_queries: Int = Field(64, ge=1, description="queries kept per chunk and query head (N_Q)")


class QuestOptions(_Strict):
    gqa_reduce: Literal["max", "sum", "union"] = "max"
    # How prefill chunks rank past pages (Quest's paper selects in decode steps only; decode steps
    # always use the bounds). exact: QuoKA's scores (``quoka.num_queries`` subselected queries,
    # cosine with every key of the page; every query of the chunk unless ``chunk_query_window`` is
    # set), reading every past key once per chunk and layer; bounds: the page bounds, max over the
    # chunk's queries (its last ``chunk_query_window``, 64 by default). Also the candidates of
    # Twilight over Quest. None: the method's default (``SparseConfig.quest_prefill_scores``).
    prefill_scores: Literal["exact", "bounds"] | None = None
    # What decode steps rank pages by: the min/max planes in the cache dtype, or their INT8 codes
    # (``metadata.minmax_int8``, stored beside them in every page), which a decode step reads in half
    # the bytes: on an H100 Quest's decode selection at 16 x 16K, pages of 32, 24.8 -> 22.4 us per layer
    # (session 28); on Qwen2.5-Coder-0.5B at 8K its decode pages cover 0.0003 less attention mass.
    decode_planes: Literal["cache", "int8"] = "cache"


class TwilightOptions(_Strict):
    """Twilight: the base selector proposes ``candidate_fraction`` of the context as candidates
    (clamped by ``budget.max_tokens`` when set; the budget's fraction only decides, as for every
    method, whether a request runs sparse at all); a decode step's candidate pages are then pruned to
    the smallest set whose estimated attention mass reaches ``top_p``, so its rows attend at most
    ``candidate_fraction`` of the context plus the forced pages, usually far fewer.

    ``prune_prefill``: prune prefill chunks' candidates too, by the mass their last
    ``chunk_query_window`` queries estimate (and rank them by the bounds, ``quest_prefill_scores``).
    Off by default: the paper prunes decode steps only, and a chunk's pruned set serves the few
    queries that estimated it, not the thousands that attend it. An unpruned chunk attends the budget's
    pages (Quest's exact-ranked chunk pages), not ``candidate_fraction``: what it attends is what the
    budget says it costs. On Qwen2.5-Coder-1.5B at 32K
    (shipped config, 25%, 80 prompts, one H200, same run) unpruned chunks answered -0.06
    [-0.12, -0.01] against dense and pruned ones -0.15 [-0.21, -0.09] (+0.09 [+0.03, +0.14] paired;
    a 256-query estimate did not help: -0.16); identical at 16K, where the cost model ran the chunks
    dense (benchmarks/results/eval_qwen1.5b_gpu_session17/)."""

    top_p: Float = Field(0.95, gt=0.0, le=1.0)
    candidates: Literal["quest", "quoka"] = "quest"
    candidate_fraction: Float = Field(0.25, gt=0.0, le=1.0)
    prune_prefill: Bool = False


EVENLY_SPACED = "evenly_spaced"


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """The model's KV heads that tensor-parallel rank ``rank`` of ``tp_size`` holds, in its local
    order: a contiguous ``num_kv_heads / tp_size`` of them, or, with fewer KV heads than ranks, the one
    head that ``tp_size / num_kv_heads`` consecutive ranks replicate (vLLM's QKV sharding)."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return list(range(rank * per, (rank + 1) * per))
    return [rank * num_kv_heads // tp_size]


class KascadeOptions(_Strict):
    """Kascade: anchor layers score every past page exactly; each layer after an anchor, up to the
    next one, reuses that anchor's page ranking, its KV head ``h`` reading the anchor's KV head
    ``head_map[layer][h]`` (identity where a layer has no entry).

    ``anchors``: the calibrated anchor layers (``vllm-sparse calibrate``), layer 0 first; None (the
    default) fails at engine start with how to calibrate; ``evenly_spaced`` asks explicitly for
    ``num_anchors`` uncalibrated anchors ``round(i * L / num_anchors)``.
    """

    anchors: list[Index] | Literal["evenly_spaced"] | None = None
    num_anchors: Int = Field(5, ge=1, description="anchors of evenly_spaced")
    head_map: dict[Annotated[int, Field(ge=0)], list[Index]] = Field(default_factory=dict)
    tile: Int = Field(32, ge=1, description="prefill queries pooled into one distribution (paper: 128 incl. GQA)")
    tile_stride: Int = Field(
        1, ge=1,
        description="anchors score a prefill chunk's last tile and every tile_stride-th before it (1: every tile, "
        "the paper's rule)",
    )  # fmt: skip

    def anchor_layers(self, num_layers: int) -> list[int]:
        """The anchor layers for a model of ``num_layers`` layers (``[]`` if not calibrated)."""
        if self.anchors == EVENLY_SPACED:
            m = min(self.num_anchors, num_layers)
            return sorted({round(i * num_layers / m) for i in range(m)})
        return list(self.anchors or [])

    def local_head_map(self, layer: int, heads: list[int] | None = None) -> list[int] | None:
        """Layer ``layer``'s head map over the KV heads one worker holds (None: identity).

        ``heads``: the model's KV heads of this worker in its local order (``kv_heads_of_rank``;
        None: all of them, no tensor parallelism). Local head ``i`` (model head ``heads[i]``) reads
        the local head that holds anchor head ``head_map[heads[i]]``, which must be one of ``heads``
        (``model_reasons`` refuses maps that cross ranks at engine start)."""
        full = self.head_map.get(layer)
        if full is None or heads is None:
            return full
        local = [heads.index(full[h]) for h in heads]
        return None if local == list(range(len(heads))) else local

    def model_reasons(self, num_layers: int, num_kv_heads: int | None, tp_size: int = 1) -> list[str]:
        """Reasons these options do not fit a model (``kascade.*`` fields), served with tensor
        parallelism ``tp_size``."""
        if self.anchors is None:
            return [
                "kascade.anchors: no calibrated anchor layers for this model; calibrate them with "
                "`vllm-sparse calibrate --model MODEL --out MODEL.yaml` and pass the file with "
                "--additional-config '{\"sparse_attention\": {\"config\": \"MODEL.yaml\"}}' (or "
                f"${ENV_VAR}=MODEL.yaml), or ask for uncalibrated anchors explicitly with "
                "kascade: {anchors: evenly_spaced}"
            ]
        reasons = []
        anchors = self.anchor_layers(num_layers)
        if anchors[:1] != [0]:
            reasons.append(f"kascade.anchors = {anchors}: must start with layer 0 (dense, the first anchor)")
        if anchors != sorted(set(anchors)):
            reasons.append(f"kascade.anchors = {anchors}: must be strictly increasing")
        bad = [a for a in anchors if not 0 <= a < num_layers]
        if bad:
            reasons.append(f"kascade.anchors: {bad} not layers of this model (0..{num_layers - 1})")
        for layer, heads in self.head_map.items():
            if not 0 <= layer < num_layers or layer in anchors:
                reasons.append(f"kascade.head_map: key {layer} is not a reuse layer of this model")
            if num_kv_heads is not None and (
                len(heads) != num_kv_heads or any(not 0 <= h < num_kv_heads for h in heads)
            ):
                reasons.append(
                    f"kascade.head_map.{layer} = {heads}: must list {num_kv_heads} anchor KV heads in 0..{num_kv_heads - 1}"
                )
            elif num_kv_heads is not None and tp_size > 1:
                reasons += self._tp_reasons(layer, heads, num_kv_heads, tp_size)
        return reasons

    @staticmethod
    def _tp_reasons(layer: int, heads: list[int], num_kv_heads: int, tp_size: int) -> list[str]:
        """A reuse layer reads its anchor's pages from the same worker: every KV head's anchor head
        must live on its rank."""
        crossing = []
        for rank in range(tp_size):
            held = kv_heads_of_rank(num_kv_heads, tp_size, rank)
            crossing += [f"{h}->{heads[h]}" for h in held if heads[h] not in held]
        if not crossing:
            return []
        return [
            f"kascade.head_map.{layer} = {heads}: with --tensor-parallel-size {tp_size} each rank holds "
            f"{max(1, num_kv_heads // tp_size)} of the {num_kv_heads} KV heads, and KV heads "
            f"{', '.join(crossing)} would read an anchor head held by another rank; calibrate a map "
            f"within each rank's heads, serve with a smaller tensor-parallel size, or leave this layer "
            f"out of kascade.head_map (identity)"
        ]


#: tokens of a FlashPrefill block; ``compact.block_pages`` defaults to the nearest whole number of pages
COMPACT_BLOCK_TOKENS = 128


class CompactOptions(_Strict):
    """CompactAttention-FP (``selectors.compact``): per tile of ``tile`` chunk queries and query head,
    FlashPrefill's normalised block score over mean-pooled key blocks of ``block_pages`` pages; a past
    block is kept where its score reaches ``block_threshold`` (alpha) times the best block's, then
    united over the chunk's tiles and over the query heads of each KV head. No budget: how many pages
    a row attends follows from alpha (``budget`` only decides nothing here; ``dense_below_tokens``,
    ``dense_layers``, sink and local pages apply as for every method).

    ``block_threshold``: alpha; 0 keeps every block (a covering setting, for tests).
    ``block_pages``: pages per block; None: ``round(128 / page_size)`` (at least 1).
    ``tile``: chunk queries per tile (FlashPrefill: 128, its block size).
    ``query_subgroup``: query heads per execution group; None: the whole KV group (the only one the
    executors run; a smaller sub-group, the paper's 4 for GQA ratios above 4, is refused at start).
    """

    block_threshold: Float = Field(0.06, ge=0.0, le=1.0)
    block_pages: Int | None = Field(None, ge=1)
    tile: Int = Field(128, ge=1, description="chunk queries per tile")
    query_subgroup: Int | None = Field(None, ge=1)

    def pages_per_block(self, page_size: int) -> int:
        """Pages of one block at ``page_size``: ``block_pages`` or about 128 tokens' worth."""
        if self.block_pages is not None:
            return self.block_pages
        return max(1, round(COMPACT_BLOCK_TOKENS / page_size))

    def engine_reasons(self, sparse_decode: bool | None, num_heads: int | None, num_kv_heads: int | None) -> list[str]:
        """Reasons these options cannot run on an engine (``compact.*`` and ``sparse_decode``)."""
        reasons = []
        if sparse_decode:
            reasons.append(
                "sparse_decode = True: sparse_compact selects pages for prefill chunks only (the paper's "
                "method); its decode steps run dense (leave sparse_decode unset or false)"
            )
        group = num_heads // num_kv_heads if num_heads and num_kv_heads else None
        sub = self.query_subgroup
        if sub is not None and (group is None or sub < group):
            reasons.append(
                f"compact.query_subgroup = {sub}: the executors run one page table per (request, KV head), "
                f"so sub-groups smaller than the GQA group ({group if group else 'unknown'} query heads per "
                "KV head) are not supported; leave it unset (the whole group shares one table)"
            )
        return reasons


class BudgetOverride(_Strict):
    """A partial budget: only the fields given replace the top-level budget's."""

    fraction: Float | None = Field(None, gt=0.0, le=1.0)
    min_tokens: Int | None = Field(None, ge=0)
    max_tokens: Int | None = Field(None, ge=1)  # an explicit null means "no maximum"

    def apply(self, base: Budget) -> Budget:
        return Budget(**{**base.model_dump(), **self.model_dump(exclude_unset=True)})


class LayerOverride(_Strict):
    """Per-layer overrides; unset fields inherit the top-level value."""

    budget: BudgetOverride | None = None
    sink_tokens: Int | None = Field(None, ge=0)
    local_tokens: Int | None = Field(None, ge=0)
    dense: Bool | None = None
    # This layer's decode steps sparse or dense, in place of the top-level ``sparse_decode`` (prefill
    # chunks keep the layer's other settings). On Qwen2.5-Coder-1.5B at 32K a variable-tracking answer
    # that every sparse decode loses comes back with one layer's decode dense (layer 7), where a budget of
    # 50% in every layer does not (benchmarks/results/decode_tail_probe/).
    sparse_decode: Bool | None = None


#: ``chunk_query_window`` of each method when the config leaves it unset (see the field); methods not
#: listed score a prefill chunk's pages with every query of the chunk
DEFAULT_CHUNK_QUERY_WINDOW: dict[str, int] = {"quest": 64, "twilight": 64}
#: methods whose decode steps run dense when ``sparse_decode`` is unset (see the field)
DENSE_DECODE = ("quoka", "compact")


class SparseConfig(_Strict):
    method: Method = "quoka"
    budget: Budget = Budget()
    sink_tokens: Int = Field(16, ge=0)
    local_tokens: Int = Field(512, ge=0)
    dense_layers: list[Index] = Field(default_factory=lambda: [0])
    dense_below_tokens: Int = Field(4096, ge=0)
    # Decode steps (one query token) sparse or dense; None: the method's default, dense for QuoKA
    # (its scoring reads every past key, so a decode step saves little and pays the selection:
    # 1.23x dense's decode throughput at 16 x 16K on an H100, and on Qwen2.5-Coder-1.5B -0.02 at 16K
    # and -0.03 at 32K against dense where dense decode gives +0.00, benchmarks/results/
    # eval_qwen_gpu_session21/) and compact (a prefill-only method; true is refused
    # at start) and sparse for Quest and Twilight (page metadata)
    # where it pays: on GPUs with a measured break-even (``cost.decode_break_even_tokens``) a step
    # whose decode rows add up to fewer past tokens decodes dense; True: every decode row past
    # ``dense_below_tokens`` sparse; False: decode dense.
    sparse_decode: Bool | None = None
    # Prefill chunks sparse or dense; None: decided per chunk from cost (``vllm_sparse.cost``: on
    # GPUs with a measured cost table a chunk runs sparse only where the modelled sparse time,
    # selection included, beats dense FlashAttention; elsewhere every chunk past
    # ``dense_below_tokens`` runs sparse); True: every such chunk sparse; False: prefill dense.
    sparse_prefill: Bool | None = None
    # Prefill chunks score pages with their last ``chunk_query_window`` queries only; 0: every query
    # of the chunk (the papers' rule); None: the method's default (``DEFAULT_CHUNK_QUERY_WINDOW``):
    # 64 for Twilight (under ``twilight.prune_prefill`` its INT4 mass estimate over every query of an 8K
    # chunk made TTFT at 128K 5x slower than dense; with 64, faster than dense, benchmarks/results/e2e_gpu.json)
    # and for Quest (the prompt's last chunk then selects for its question and answer prefix, whose
    # last token gives the first answer token; dense accuracy on the 0.5B needle eval at 8K and 16K,
    # benchmarks/results/eval_qwen0.5b_cpu_query_window/; on the 1.5B at 32K every query ties with it),
    # 0 for the others. QuoKA scores with every query (its paper's rule): it subselects 64 of them
    # anyway, so this costs one pass over the chunk's queries (its TTFT at 128K on an H100: 5.05 s;
    # 5.07 s with 64 in an earlier run), and on the 1.5B at 32K it answers +0.07 [+0.01, +0.13] better
    # than with 64 (benchmarks/results/eval_qwen1.5b_gpu_h100/window32k/). Kascade's anchors score with every
    # query by default (the paper's rule, two passes over the past per anchor); with 64 they score a chunk's
    # last 64 queries, and its TTFT at 128K on an H100 goes from 1.40x to 2.03x FLASH_ATTN's
    # (benchmarks/results/serve_bench_h100_session30_kascade/), but on the 0.5B at 8K it answers -0.07
    # [-0.12, -0.02] worse (benchmarks/results/eval_qwen0.5b_cpu_kascade_window/), so 0 stays its default.
    chunk_query_window: Int | None = Field(None, ge=0)
    # The last ``dense_tail_tokens`` queries of every sparse prefill chunk attend every page (dense); the
    # rest of the chunk runs sparse. The prompt's last chunk ends with the question and the chat template's
    # assistant header, whose last position gives the first answer token: a page its selection misses
    # (the head of a code) is then never seen by that token. A chunk of at most this many queries runs
    # dense. 0: off.
    dense_tail_tokens: Int = Field(0, ge=0)
    executor: Literal["auto", "reference"] = "auto"  # auto: the platform's fast executor where it applies
    # A test and diagnostic switch: rows whose budget covers the context still run the whole sparse
    # path (selection, tables, sparse executor; every page is then selected) instead of the dense
    # shortcut, so that "a covering budget equals dense" tests the selection path end to end.
    force_sparse: Bool = False
    quoka: QuokaOptions = QuokaOptions()
    quest: QuestOptions = QuestOptions()
    twilight: TwilightOptions = TwilightOptions()
    kascade: KascadeOptions = KascadeOptions()
    compact: CompactOptions = CompactOptions()
    layers: dict[Annotated[int, Field(ge=0)], LayerOverride] = Field(default_factory=dict)
    # Model names a shipped config matches besides its file name (hub names, e.g. "Qwen/Qwen3-8B");
    # no effect on the policy.
    models: list[str] = Field(default_factory=list)
    _policies: dict[int, LayerPolicy] = PrivateAttr(default_factory=dict)

    def query_window(self) -> int | None:
        """The resolved ``chunk_query_window``: a number of queries, or None for every query."""
        window = self.chunk_query_window
        if window is None:
            window = DEFAULT_CHUNK_QUERY_WINDOW.get(self.method, 0)
        return window or None

    def quest_prefill_scores(self) -> Literal["exact", "bounds"]:
        """The resolved ``quest.prefill_scores``. Default exact for Quest: on Qwen2.5-Coder-0.5B
        (shipped config, 25%, 20 prompts per task) it answered +0.05 [-0.00, +0.10] better than the
        bounds at 32K (multi-key +0.15) and +0.02 at 16K, for 2% more TTFT at 130K on an H200
        (benchmarks/results/eval_qwen0.5b_gpu_session16/). The same for Twilight's Quest candidates,
        which its prefill chunks attend unpruned (``twilight.prune_prefill`` off). Bounds for them
        under ``prune_prefill``: there the exact scores changed nothing measurable (+0.00 at 16K,
        +0.01 at 32K), since the top-p prunes the candidates anyway, and they cost selection time."""
        if self.quest.prefill_scores is not None:
            return self.quest.prefill_scores
        if self.method == "twilight" and self.twilight.prune_prefill:
            return "bounds"
        return "exact"

    def asks_sparse_decode(self) -> bool:
        """Whether the config asks for sparse decode steps anywhere (top level or a layer)."""
        return bool(self.sparse_decode) or any(o.sparse_decode for o in self.layers.values())

    def may_decode_sparse(self) -> bool:
        """Whether some layer's decode steps may run sparse (not refused by the top level and every layer)."""
        return self.sparse_decode is not False or self.asks_sparse_decode()

    def model_reasons(self, num_layers: int, num_kv_heads: int | None = None, tp_size: int = 1) -> list[str]:
        """Reasons this config does not fit a model with ``num_layers`` attention layers (and
        ``num_kv_heads`` KV heads, where known), served with tensor parallelism ``tp_size``."""
        kascade = self.method == "kascade"
        reasons = self.kascade.model_reasons(num_layers, num_kv_heads, tp_size) if kascade else []
        for idx in self.dense_layers:
            if not 0 <= idx < num_layers:
                reasons.append(f"dense_layers: {idx} is not a layer of this model (0..{num_layers - 1})")
        for idx in self.layers:
            if not 0 <= idx < num_layers:
                reasons.append(f"layers: key {idx} is not a layer of this model (0..{num_layers - 1})")
        return reasons

    def for_layer(self, layer_idx: int) -> LayerPolicy:
        """The policy of one layer, with its overrides applied (computed once per layer)."""
        policy = self._policies.get(layer_idx)
        if policy is None:
            policy = self._policies[layer_idx] = self._make_policy(layer_idx)
        return policy

    def _make_policy(self, layer_idx: int) -> LayerPolicy:
        o = self.layers.get(layer_idx, LayerOverride())
        budget = self.budget if o.budget is None else o.budget.apply(self.budget)
        dense = layer_idx in self.dense_layers if o.dense is None else o.dense
        sparse_decode = self.sparse_decode if o.sparse_decode is None else o.sparse_decode
        return LayerPolicy(
            dense=dense,
            budget=budget,
            sink_tokens=self.sink_tokens if o.sink_tokens is None else o.sink_tokens,
            local_tokens=self.local_tokens if o.local_tokens is None else o.local_tokens,
            dense_below_tokens=self.dense_below_tokens,
            select_fraction=self.twilight.candidate_fraction if self.method == "twilight" else None,
            select_fraction_prefill=self.method != "twilight" or self.twilight.prune_prefill,
            select_all=self.method == "compact",
            sparse_decode=self.method not in DENSE_DECODE if sparse_decode is None else sparse_decode,
            decode_by_cost=sparse_decode is None and self.method not in DENSE_DECODE and not self.force_sparse,
            force_sparse=self.force_sparse,
            sparse_prefill=self.sparse_prefill,
        )


@dataclass(frozen=True)
class LayerPolicy:
    """What stage 1 (policy) needs to plan one layer of one step."""

    dense: bool
    budget: Budget
    sink_tokens: int
    local_tokens: int
    dense_below_tokens: int
    # A method-specific number of pages a selector may return, as a fraction of the context, in
    # place of the budget's (twilight: its candidate fraction, clamped by ``budget.max_tokens``);
    # rows may then come back with fewer (``Selection.counts``).
    select_fraction: float | None = None
    # Whether prefill chunks take ``select_fraction`` too (Twilight under ``prune_prefill``, whose top-p
    # then prunes them) or the budget's count (chunks that attend what they select, unpruned)
    select_fraction_prefill: bool = True
    sparse_decode: bool = True  # False: decode steps (query length 1) run dense
    # True: decode steps run sparse only where the GPU's measured break-even says it pays
    # (``decode_step.DecodeColumns``); False: wherever ``sparse_decode`` and the thresholds say
    decode_by_cost: bool = False
    force_sparse: bool = False  # True: a covering budget selects every page instead of running dense
    sparse_prefill: bool | None = None  # None: the cost model decides per chunk; False: prefill dense
    # True: every non-forced past page is a candidate and the selector's own rule decides how many it
    # keeps (compact's threshold); the budget then neither caps the selection nor sends a request
    # dense because it covers the context
    select_all: bool = False

    @property
    def decodes_dense(self) -> bool:
        """Every decode row of this layer attends its whole context, whatever the step holds (a dense layer, or
        ``sparse_decode`` off): a static property, so a captured decode graph fits every replay."""
        return self.dense or not self.sparse_decode


@dataclass(frozen=True)
class ResolvedConfig:
    config: SparseConfig
    source: str


def method_of_backend(backend_name: str) -> str:
    """``SPARSE_QUOKA`` -> ``quoka``."""
    name = backend_name.lower()
    if not name.startswith("sparse_") or name[len("sparse_") :] not in METHODS:
        raise ValueError(f"{backend_name!r} is not a vllm-sparse backend name")
    return name[len("sparse_") :]


def _load_yaml(path: str | Path, source: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise SparseConfigError(source, [f"config: {str(path)!r}: file not found"])
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise SparseConfigError(source, [f"config: {str(path)!r}: not valid YAML ({e})"]) from e
    if not isinstance(data, dict):
        raise SparseConfigError(source, [f"config: {str(path)!r}: top level must be a mapping"])
    return data


def _format_errors(err: ValidationError, data: dict[str, Any], reported: bool = False) -> list[str]:
    """pydantic's errors as config reasons; ``reported``: reasons were already found (then errors reported
    elsewhere, as the budget order, may leave none here)."""
    reasons = []
    for e in err.errors():
        if "must not exceed" in e["msg"]:
            continue  # reported by _budget_order_reasons
        value = e.get("input")
        tags = [x for x in e["loc"] if isinstance(x, str) and "[" in x and x != "[key]"]  # union branches
        if any(t.startswith("literal[") for t in tags) and isinstance(value, list):
            continue  # a list given where a list or a name goes: report the list's errors only
        if e["loc"][-1:] and str(e["loc"][-1]).startswith("list[") and isinstance(value, str):
            continue  # and a name given: report the name's error only
        loc = ".".join(str(x) for x in e["loc"] if x not in tags) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            reasons.append(f"{loc}: unknown field")
        elif e["type"] == "literal_error" or isinstance(value, (int, float, str, bool, type(None))):
            reasons.append(f"{loc} = {value!r}: {msg}")
        else:
            reasons.append(f"{loc}: {msg}")
    return reasons or ([] if reported else [str(err)])  # (never empty alone: a filtered union still fails)


def _budget_order_reasons(data: dict[str, Any]) -> list[str]:
    """min_tokens <= max_tokens for the top-level budget and every layer's merged budget.

    Checked on the raw mapping so that it is reported beside other errors (pydantic skips a
    model's cross-field check once one of its fields failed).
    """
    defaults = Budget().model_dump()
    top = data.get("budget") if isinstance(data.get("budget"), dict) else {}
    scopes = [("budget", {**defaults, **top})]
    layers = data.get("layers") if isinstance(data.get("layers"), dict) else {}
    for key, layer in layers.items():
        if isinstance(layer, dict) and isinstance(layer.get("budget"), dict):
            scopes.append((f"layers.{key}.budget", {**defaults, **top, **layer["budget"]}))
    reasons = []
    for loc, b in scopes:
        lo, hi = b.get("min_tokens"), b.get("max_tokens")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            reasons.append(f"{loc}: min_tokens ({lo}) must not exceed max_tokens ({hi})")
    return reasons


#: fields a ``methods`` block may not set (they name the method or the models, not how it runs)
NOT_PER_METHOD = frozenset({"method", "methods", "models"})


def _method_blocks(data: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The ``methods`` blocks of a raw mapping (method name -> fields that only that method runs with), and the
    reasons they are malformed."""
    blocks = data.get("methods")
    if blocks is None:
        return {}, []
    if not isinstance(blocks, dict):
        return {}, [f"methods = {blocks!r}: must map method names ({', '.join(METHODS)}) to fields"]
    good, reasons = {}, []
    for name, fields in blocks.items():
        if name not in METHODS:
            reasons.append(f"methods.{name}: unknown method (one of {', '.join(METHODS)})")
        elif not isinstance(fields, dict):
            reasons.append(f"methods.{name} = {fields!r}: must be a mapping of config fields")
        elif NOT_PER_METHOD & set(fields):
            bad = ", ".join(sorted(NOT_PER_METHOD & set(fields)))
            reasons.append(f"methods.{name}: {bad} cannot be set per method")
        else:
            good[name] = fields
    return good, reasons


def apply_method_block(data: dict[str, Any], method: str) -> dict[str, Any]:
    """``data`` with its ``methods`` block for ``method`` merged over the rest and taken out of ``methods`` (the
    other blocks stay there, for ``parse_config`` to validate). Fields merged over the result later, inline ones,
    then win over the block, as they win over the rest of the file. A malformed block is left for
    ``parse_config`` to report."""
    blocks = data.get("methods")
    block = blocks.get(method) if isinstance(blocks, dict) else None
    if not isinstance(block, dict) or NOT_PER_METHOD & set(block):
        return data
    out = _deep_merge({k: v for k, v in data.items() if k != "methods"}, block)
    rest = {k: v for k, v in blocks.items() if k != method}
    return {**out, "methods": rest} if rest else out


def parse_config(data: dict[str, Any], method: str, source: str) -> SparseConfig:
    """Validate a raw mapping for ``method``; every invalid field is reported at once.

    ``methods: {quest: {budget: {min_tokens: 4096}}}`` holds fields that only one method runs with: the block of
    ``method`` is merged over the rest of the mapping (so one model config can give each method its own budget).
    The rest must be valid alone (it is what the methods without a block run), and every block is validated
    merged over it, whichever method is served, so that a bad field anywhere is reported at start."""
    blocks, block_reasons = _method_blocks(data)
    base = {k: v for k, v in data.items() if k != "methods"}
    if not blocks and not block_reasons:  # (most configs: parsed once)
        return _parse_one(base, method, source)
    shared = _faults(base, method, source)
    reasons = list(shared)
    for name, fields in blocks.items():
        own = shared if name == method else _faults(base, name, source)
        reasons += [f"methods.{name}: {r}" for r in _faults(_deep_merge(base, fields), name, source) if r not in own]
    reasons += block_reasons
    if reasons:
        raise SparseConfigError(source, reasons)
    return _parse_one(_deep_merge(base, blocks.get(method, {})), method, source)


def _faults(data: dict[str, Any], method: str, source: str) -> list[str]:
    """What ``_parse_one`` finds wrong with ``data`` for ``method`` (empty: valid)."""
    try:
        _parse_one(data, method, source)
    except SparseConfigError as e:
        return list(e.reasons)
    return []


def _parse_one(data: dict[str, Any], method: str, source: str) -> SparseConfig:
    """``parse_config`` of a mapping without ``methods`` blocks."""
    data = dict(data)
    reasons = _budget_order_reasons(data)
    if "method" in data and data["method"] != method:
        reasons.append(
            f"method = {data['method']!r}: does not match the backend sparse_{method} "
            f"(the method comes from --attention-backend; drop the field or make them agree)"
        )
        data.pop("method")
    try:
        cfg = SparseConfig(**{**data, "method": method})
    except ValidationError as e:
        reasons += _format_errors(e, data, reported=bool(reasons))
        cfg = None
    if reasons:
        raise SparseConfigError(source, reasons)
    assert cfg is not None
    return cfg


def shipped_configs() -> dict[Path, list[str]]:
    """Every shipped config and the model names it matches: its file name, then its ``models``."""
    out = {}
    for p in sorted(SHIPPED_DIR.glob("*.yaml")):
        data = yaml.safe_load(p.read_text()) or {}
        models = data.get("models") or []
        out[p] = [p.stem, *[str(m) for m in ([models] if isinstance(models, str) else models)]]
    return out


def match_shipped_config(model: str | None) -> tuple[Path, str] | None:
    """The shipped config for ``model`` (a hub name or a local path) and the rule that matched, all
    comparisons case-insensitive, first rule wins: (1) the file name equals the model's last path
    component; (2) a name in a config's ``models`` equals the model; (3) the last component of a
    name in a config's ``models`` equals the model's last path component."""
    if not model:
        return None
    name = str(model).strip().rstrip("/").lower()
    last = Path(name).name
    if not last:
        return None
    configs = shipped_configs()
    for p in configs:
        if p.stem.lower() == last:
            return p, f"file name {p.name} = the model's last path component {last!r}"
    for p, names in configs.items():
        for n in names[1:]:
            if n.strip().rstrip("/").lower() == name:
                return p, f"its models list names {n!r}"
    for p, names in configs.items():
        for n in names[1:]:
            if Path(n.strip().rstrip("/").lower()).name == last:
                return p, f"its models list names {n!r}, whose last component is the model's {last!r}"
    return None


def shipped_config_path(model: str | None) -> Path | None:
    """The shipped YAML for ``model`` (``match_shipped_config``), or None."""
    found = match_shipped_config(model)
    return None if found is None else found[0]


def resolve_config(
    method: str,
    model: str | None = None,
    additional_config: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> ResolvedConfig:
    """Find, load and validate the selector config for ``method`` and ``model``."""
    environ = os.environ if environ is None else environ
    extra = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if extra is not None:
        source = f"--additional-config {ADDITIONAL_CONFIG_KEY}"
        if not isinstance(extra, dict):
            raise SparseConfigError(source, [f"{ADDITIONAL_CONFIG_KEY} = {extra!r}: must be a mapping"])
        inline = dict(extra)
        path = inline.pop("config", None)
        data = {}
        if path is not None:
            source += f" (config {path})"
            data = apply_method_block(_load_yaml(path, source), method)  # inline fields win over its block
        return ResolvedConfig(parse_config(_deep_merge(data, inline), method, source), source)
    if environ.get(ENV_VAR):
        source = f"${ENV_VAR}={environ[ENV_VAR]}"
        return ResolvedConfig(parse_config(_load_yaml(environ[ENV_VAR], source), method, source), source)
    found = match_shipped_config(model)
    if found is not None:
        shipped, why = found
        source = f"shipped {shipped.name} ({why})"
        return ResolvedConfig(parse_config(_load_yaml(shipped, source), method, source), source)
    source = "defaults (no shipped config matches the model)" if model else "defaults"
    return ResolvedConfig(parse_config({}, method, source), source)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
