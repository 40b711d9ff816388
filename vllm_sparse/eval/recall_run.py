"""Run the attention-recall measure (``eval/recall.py``) on a real model and the eval tasks' prompts.

Per prompt: capture every layer's post-RoPE queries and keys (``eval/capture.py``, chunked
prefill as vLLM runs it, then one greedy decode step); then for every layer, budget and method the
selector's pages (``eval/recall_select.py``, the shipped config's settings) and their recall beside
the oracle's at the same page counts, in three phases:

* ``prefill``: the prompt's last chunk (every query of it), with the chunk's selection;
* ``prefill_last``: the last query of that chunk (the prompt's last token, whose output is the first
  answer token), with the same selection;
* ``decode``: the first decode token, with its own selection;
* ``decode_answer`` (with ``decode_steps > 1``): each later decode token of the model's own greedy
  answer, each with its own selection (records carry ``step``: ``decode+1``, ``decode+2``, ...), so
  the measure follows the answer where a multi-value or variable-tracking answer loses its later items.

One record per (prompt, phase, budget, method, layer); ``engine_dense`` marks the records whose
layer and step the engine runs dense (dense layers, QuoKA's dense decode), measured anyway.

Kascade's pages in a layer come from its anchor layer's queries and keys, not the layer's own: the
anchor mass of each (anchor layer, step) is computed once per prompt from that layer's captures
(``AnchorMasses``) and passed to ``select`` by every layer up to the next anchor, at every budget.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_sparse.eval.tasks import Sample

if TYPE_CHECKING:
    import torch

    from vllm_sparse.config import SparseConfig

PHASES = ("prefill", "prefill_last", "decode", "decode_answer")


@dataclass
class RecallConfig:
    """Everything a run needs; the defaults are the CPU run of ``benchmarks/results/attention_recall_*``."""

    model: str = "qwen2.5-coder-0.5b-instruct"
    tasks: Sequence[str] = ("niah_single", "niah_multikey", "vt")
    contexts: Sequence[int] = (8192,)
    samples: int = 2
    depths: Sequence[float] = (0.1, 0.5, 0.9)
    seed: int = 0
    methods: Sequence[str] = ("quoka", "quest", "twilight")
    # name -> (method, further sparse_attention fields), e.g. {"quoka_w64": ("quoka", {"chunk_query_window": 64})}
    variants: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    budgets: Sequence[float] = (0.125, 0.25)
    decode_steps: int = 1  # greedy answer tokens measured (1: the first decode token only)
    page_size: int = 16
    chunk_size: int = 2048
    dtype: str = "bfloat16"
    sparse_config: str | None = None  # YAML path; None: the shipped config matched on the model
    out_dir: str = "attention_recall"
    progress: bool = True
    command: str = ""


def method_configs(cfg: RecallConfig, base: dict[str, Any]) -> dict[tuple[float, str], Any]:
    """``{(budget, name): SparseConfig}``: the base YAML's fields with the budget's fraction."""
    from vllm_sparse.config import parse_config

    named = {m: (m, {}) for m in cfg.methods} | dict(cfg.variants)
    out = {}
    for b in cfg.budgets:
        for name, (method, extra) in named.items():
            data = _merge(_merge(base, extra), {"budget": {"fraction": b}})
            out[(b, name)] = parse_config(data, method, f"recall {name}@{b:g}")
    return out


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s fields, nested mappings merged."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def needle_pages(tokenizer, sample: Sample, page_size: int) -> torch.Tensor:
    """``int64 [n]`` logical pages holding any occurrence of an expected answer in the prompt's
    text before the question (the last 300 characters are left out)."""
    import re

    import torch

    enc = tokenizer(sample.prompt, add_special_tokens=False, return_offsets_mapping=True)
    body = len(sample.prompt) - 300
    pages = set()
    for want in sample.expected:
        for m in re.finditer(re.escape(want), sample.prompt[:body]):
            for i, (a, b) in enumerate(enc["offset_mapping"]):
                if a < m.end() and b > m.start():
                    pages.add(i // page_size)
    return torch.tensor(sorted(pages), dtype=torch.int64)


def _needle_fields(mass, needle, forced, selected, oracle) -> dict[str, Any]:
    """A record's needle fields (``eval/recall.py``): ``needle`` (share of the needle's past pages
    attended per KV head, None without any), ``needle_mass`` (dense mass on them per KV head) and
    ``needle_covered`` (its attended part); ``oracle_*``: the same for the oracle's pages."""
    from vllm_sparse.eval.recall import needle_coverage, needle_mass

    num_past = mass.past.shape[-1]
    total, got = needle_mass(mass, needle, forced, selected)
    _, oracle_got = needle_mass(mass, needle, forced, oracle)
    r4 = lambda xs: [round(x, 5) for x in xs]  # noqa: E731
    return {
        "needle": needle_coverage(needle, forced, selected, num_past),
        "oracle_needle": needle_coverage(needle, forced, oracle, num_past),
        "needle_mass": r4(total), "needle_covered": r4(got), "oracle_needle_covered": r4(oracle_got),
    }  # fmt: skip


class AnchorMasses:
    """Kascade's anchor masses of one prompt (``recall_select.anchor_mass``), each computed once per
    (anchor layer, step, tile, query window) from the anchor layer's captured queries and keys and
    read by every layer up to the next anchor, at every budget."""

    def __init__(self, inputs: Callable[[int], dict[str, tuple]], num_layers: int, page_size: int, scale: float):
        """``inputs(layer)``: that layer's ``{step: (queries [C, Hq, D], keys [S, Hkv, D])}``."""
        self.inputs, self.num_layers, self.page_size, self.scale = inputs, num_layers, page_size, scale
        self.masses: dict[tuple, torch.Tensor] = {}

    def anchor_layer(self, config: SparseConfig, layer: int) -> int:
        """The anchor layer whose pages ``layer`` keeps (``KascadeSelector``'s rule)."""
        from vllm_sparse.selectors.kascade import KascadeSelector

        return KascadeSelector(config, layer=layer, num_layers=self.num_layers).anchor

    def __call__(self, config: SparseConfig, layer: int, step: str) -> torch.Tensor:
        """``float32 [Hkv, P]`` the mass ``layer``'s anchor layer gives the past pages of ``step``."""
        from vllm_sparse.eval.recall_select import anchor_mass

        anchor = self.anchor_layer(config, layer)
        key = (anchor, step, config.kascade.tile, config.kascade.tile_stride, config.query_window())
        if key not in self.masses:
            q, k = self.inputs(anchor)[step]
            self.masses[key] = anchor_mass(config, q, k, self.page_size, self.scale)
        return self.masses[key]


def measure_layer(configs: dict, layer: int, steps: dict[str, tuple], needle: torch.Tensor, page_size: int,
                  scale: float, anchors: AnchorMasses | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Records of one layer: ``steps`` maps a selection step (``prefill``, ``decode``) to
    ``(queries [C, Hq, D], keys [S, Hkv, D], {phase: PageMass})``; ``anchors``: the prompt's anchor
    masses, needed by Kascade's configs."""
    from vllm_sparse.eval.recall import covered, oracle_pages, selectable_share
    from vllm_sparse.eval.recall_select import select

    out = []
    for (budget, name), config in configs.items():
        policy = config.for_layer(layer)
        if config.method == "kascade" and anchors is None:
            raise ValueError(f"recall {name}: kascade needs the anchor layers' masses (anchors=AnchorMasses(...))")
        for step, (q, keys, masses) in steps.items():
            anchor = anchors(config, layer, step) if config.method == "kascade" else None
            choice = select(config, layer, q, keys, page_size, scale, anchor)
            plan = choice.plan  # (not sparse: the budget covers the context, every past page is forced)
            counts = [int(s.numel()) for s in choice.selected]
            decoding = step.startswith("decode")
            engine_dense = policy.dense or (decoding and not policy.sparse_decode) or not plan.sparse
            for phase, mass in masses.items():
                oracle = oracle_pages(mass, choice.forced_past, counts)
                rec, orc = covered(mass, choice.forced_past, choice.selected), covered(mass, choice.forced_past, oracle)
                out.append({
                    "phase": phase, "step": step, "budget": budget, "method": name, "base_method": config.method, "layer": layer,
                    "dense_layer": bool(policy.dense), "engine_dense": bool(engine_dense), "past_pages": plan.num_past_pages,
                    "forced_pages": int(choice.forced_past.numel()), "selected_pages": counts,
                    "recall": round(float(rec.mean()), 5), "oracle": round(float(orc.mean()), 5),
                    "recall_heads": [[round(x, 4) for x in row] for row in rec.tolist()],
                    "oracle_heads": [[round(x, 4) for x in row] for row in orc.tolist()],
                    "selectable": round(float(selectable_share(mass, choice.forced_past, rec).mean()), 5),
                    "oracle_selectable": round(float(selectable_share(mass, choice.forced_past, orc).mean()), 5),
                    **_needle_fields(mass, needle, choice.forced_past, choice.selected, oracle),
                })  # fmt: skip
    return out


def step_inputs(cap, layer: int, t: int, start: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``layer``'s captured ``{step: (queries, keys)}`` of a ``t``-token prompt whose last prefill
    chunk starts at ``start``: ``prefill``, the chunk's ``[t - start, Hq, D]`` and keys ``[t, Hkv, D]``;
    ``decode``, the first decode token's ``[1, Hq, D]`` and keys ``[t + 1, Hkv, D]``; ``decode+j``
    (``j >= 1``, one per further decode token captured), its ``[1, Hq, D]`` and keys ``[t + j + 1, Hkv, D]``."""
    q, k = cap.queries[layer], cap.keys[layer]
    out = {"prefill": (q[: t - start], k[:t])}
    for j in range(q.shape[0] - (t - start)):
        row = t - start + j
        out["decode" if j == 0 else f"decode+{j}"] = (q[row : row + 1], k[: t + j + 1])
    return out


def check_configs(configs: dict, num_layers: int, num_kv_heads: int | None) -> None:
    """Raise ``ValueError`` with the reasons a Kascade config does not fit the model (its anchor
    layers and head maps; the engine's start-up check)."""
    reasons = [f"recall {name}@{budget:g}: {r}" for (budget, name), config in configs.items()
               if config.method == "kascade" for r in config.model_reasons(num_layers, num_kv_heads)]  # fmt: skip
    if reasons:
        raise ValueError("\n".join(reasons))


def measure_prompt(model, tokenizer, sample: Sample, configs: dict, cfg: RecallConfig) -> tuple[dict, list]:
    """Capture one prompt and measure every layer; returns (prompt info, records)."""
    import torch
    from tqdm.auto import tqdm

    from vllm_sparse.eval.capture import capture
    from vllm_sparse.eval.recall import dense_page_mass

    ids = tokenizer.encode(sample.prompt, add_special_tokens=False)
    t = len(ids)
    start = ((t - 1) // cfg.chunk_size) * cfg.chunk_size  # the last prefill chunk, as vLLM chunks
    t0 = time.perf_counter()
    cap = capture(model, ids, keep_from=start, chunk_size=cfg.chunk_size, cache_dtype=getattr(torch, cfg.dtype),
                  progress=cfg.progress, decode_steps=cfg.decode_steps)  # fmt: skip
    capture_s = time.perf_counter() - t0
    n = cfg.page_size
    needle = needle_pages(tokenizer, sample, n)
    records = []
    inputs = functools.partial(step_inputs, cap, t=t, start=start)  # layer -> {step: (queries, keys)}
    anchors = AnchorMasses(inputs, len(cap.keys), n, cap.scale)
    for layer in tqdm(range(len(cap.keys)), desc="layers", disable=not cfg.progress, leave=False):
        layer_inputs = inputs(layer)
        chunk_q, chunk_k = layer_inputs.pop("prefill")
        steps = {
            "prefill": (chunk_q, chunk_k, {
                "prefill": dense_page_mass(chunk_q, chunk_k, start // n, n, cap.scale),
                "prefill_last": dense_page_mass(chunk_q[-1:], chunk_k, start // n, n, cap.scale),
            }),
        }  # fmt: skip
        for step, (dec_q, dec_k) in layer_inputs.items():  # decode, decode+1, ...: the query at dec_k's last key
            phase = "decode" if step == "decode" else "decode_answer"
            steps[step] = (
                dec_q,
                dec_k,
                {phase: dense_page_mass(dec_q, dec_k, (dec_k.shape[0] - 1) // n, n, cap.scale)},
            )
        records += measure_layer(configs, layer, steps, needle, n, cap.scale, anchors)
    info = {
        "task": sample.task, "context": sample.context, "index": sample.index, "depth": sample.depth,
        "prompt_tokens": t, "prompt_hash": sample.prompt_hash, "expected": list(sample.expected),
        "last_chunk": [start, t], "needle_pages": needle.tolist(),
        "first_token": tokenizer.decode([cap.decode_token]), "answer": tokenizer.decode(cap.decode_tokens),
        "capture_s": round(capture_s, 1),
    }  # fmt: skip
    return info, records


def run_recall(cfg: RecallConfig) -> dict[str, Any]:
    """Measure every prompt; write ``recall.json`` (config, command, prompts, records, summary),
    the plots and ``tables.md`` into ``cfg.out_dir``; returns the JSON's content."""
    import torch
    import yaml

    from vllm_sparse.config import match_shipped_config
    from vllm_sparse.eval.capture import load_model
    from vllm_sparse.eval.models import resolve_model
    from vllm_sparse.eval.recall_report import summarize, write_outputs
    from vllm_sparse.eval.report import machine_info
    from vllm_sparse.eval.tasks import make_samples

    if cfg.decode_steps < 1:  # refused before the model loads, not at the first prompt's capture
        raise ValueError(f"decode_steps must be at least 1, got {cfg.decode_steps}")
    t0 = time.perf_counter()
    path = resolve_model(cfg.model, progress=cfg.progress)
    yaml_path = Path(cfg.sparse_config) if cfg.sparse_config else (match_shipped_config(cfg.model) or (None,))[0]
    base = yaml.safe_load(yaml_path.read_text()) if yaml_path else {}
    configs = method_configs(cfg, base)
    model, tokenizer = load_model(path, getattr(torch, cfg.dtype))
    check_configs(configs, model.config.num_hidden_layers, getattr(model.config, "num_key_value_heads", None))
    samples = [s for ctx in cfg.contexts for task in cfg.tasks
               for s in make_samples(tokenizer, task, ctx, cfg.samples, cfg.depths, cfg.seed)]  # fmt: skip
    prompts, records = [], []
    for i, sample in enumerate(samples):
        print(f"[vllm-sparse recall] prompt {i + 1}/{len(samples)}: {sample.task} @ {sample.context}", flush=True)
        info, recs = measure_prompt(model, tokenizer, sample, configs, cfg)
        prompts.append(info)
        records += [{"prompt": i, "context": sample.context, **r} for r in recs]
    result = {
        "command": cfg.command, "model": cfg.model, "model_path": path, "machine": machine_info(),
        "config": asdict(cfg), "sparse_config": {"file": yaml_path.name if yaml_path else None, "fields": base},
        "num_layers": model.config.num_hidden_layers, "prompts": prompts,
        "summary": summarize(records), "seconds": round(time.perf_counter() - t0, 1), "records": records,
    }  # fmt: skip
    write_outputs(result, Path(cfg.out_dir))
    return result


def load(path: str | Path) -> dict[str, Any]:
    """A ``recall.json`` written by :func:`run_recall`."""
    return json.loads(Path(path).read_text())
