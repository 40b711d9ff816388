"""Does Quest's page selection survive storing the key min/max planes in fewer bytes? (CPU, real model)

Quest keeps, per (page, KV head), the channel-wise min and max of the page's keys (``kmin``, ``kmax``,
``D`` channels each, in the cache dtype: bf16, ``2 * D * 2`` bytes) and ranks pages by the upper bound
``sum_d max(q_d * kmax_d, q_d * kmin_d)``. This script stores the planes in fewer bytes, rounded
*outward* so that they still bound every key of the page, and measures what the selection loses, on
Qwen2.5-Coder-0.5B-Instruct (D = 64, 2 KV heads, 14 query heads, 24 layers) with real weights on the
eval tasks' own prompts, with the machinery of ``vllm-sparse recall`` (``vllm_sparse/eval/recall*.py``):

* capture every layer's post-RoPE queries and keys (``eval/capture.py``: chunked prefill of 2048 tokens
  as vLLM runs it on the CPU, then one greedy decode step; keys rounded to bf16 as the cache keeps them);
* for every layer and step the dense attention mass per past page (``eval/recall.py``), pages of 32
  (Quest's GPU default);
* Quest's pages from each format's planes: ``request_plan`` (the shipped config
  ``configs/qwen2.5-coder-0.5b-instruct.yaml``: budget 25%, sink 16, local 512 tokens), ``page_views``,
  ``chunk_queries`` (its query window: a chunk scores with its last 64 queries),
  ``quest.page_upper_bounds``, ``quest.reduce_and_pick`` (its ``gqa_reduce``), exactly as
  ``eval/recall_select.select`` picks for Quest; the ``bf16`` format is asserted to give
  ``select``'s own pages at every (layer, step).

Formats of the planes (bytes per (page, KV head) with ``D`` channels):

* ``bf16`` (``4 D``): today's planes, the min/max of keys that are already bf16 (exact bf16 values).
* ``int8_vec`` (``2 D + 4``): one float32 scale ``s = max(|kmin|, |kmax|) / 127`` per (page, KV head)
  (``s = 1`` where the page's keys are all 0; nudged up by one float32 ulp where ``absmax / s > 127``),
  ``kmin_q = floor(kmin / s)``, ``kmax_q = ceil(kmax / s)`` in ``[-127, 127]``, read back as ``q * s``.
  Computed in float64, where ``q * s`` is exact, and checked to bound the keys there and again after
  the cast to float32 (rounding to nearest is monotone and the bf16 planes are float32 values). The
  format of ``vllm_sparse/metadata/minmax_int8.py``, which the Triton bounds kernels read, and built by
  it (the recorded run used an equal float64 copy of it here, checked to give the same planes).
* ``fp8_e4m3`` (``2 D``): the planes cast to ``float8_e4m3fn`` and rounded outward (cast to nearest,
  compare the value back, step one code through the uint8 bit pattern where it does not bound).
  ``e4m3fn`` ends at +-448: an entry beyond it (``kmin < -448`` or ``kmax > 448``) cannot be bounded;
  such entries are clamped to +-448 for the selection and counted (``planes_over_448``: entries of
  magnitude above 448; ``planes_unbounded``: the ones whose clamped value no longer bounds).
* ``fp8_vec`` (``2 D + 4``): ``fp8_e4m3`` of ``x / s`` with a float32 scale ``s = absmax / 448`` per
  (page, KV head) (nudged as for int8), outward, read back as ``code * s`` (exact in float64).

Steps: ``decode`` (the first decode token, one query) and ``prefill`` (the prompt's last chunk, ranked
by the bounds, max over its last 64 queries; its recall is the mean over every query of the chunk).
Under the shipped config the engine ranks a Quest prefill chunk by exact scores
(``quest.prefill_scores: exact``), not by the bounds, so the ``prefill`` rows stand for
``prefill_scores: bounds`` (and Twilight's candidates under ``prune_prefill``); the config is built with
``quest.prefill_scores: bounds`` for that reason. Layer 0 (``dense_layers``) is not measured; layers
6-11 decode dense under the shipped config: their decode records are measured and marked
``engine_dense``. Twilight's decode candidates are Quest's pages, so the decode rows bear on it too.

Per (prompt, layer, step, format): recall (mean over query heads; ``eval/recall.covered``), the
oracle's recall at the same page counts, the selectable share, the overlap with the ``bf16`` selection
(the share of the bf16 pages it keeps, mean and min over KV heads), the plane entries beyond 448
(fp8), the planes' widening (mean of ``kmax' - kmax + kmin - kmin'``). Written to
``OUT/minmax_precision.json`` and ``OUT/README.md`` (summary table).

The recorded run (``benchmarks/results/minmax_precision_qwen0.5b_cpu/``, 2 shared CPU cores):

    python benchmarks/minmax_precision_cpu.py --contexts 8192 --samples 6 \\
        --out benchmarks/results/minmax_precision_qwen0.5b_cpu

(``--samples`` is the prompt count per (task, context); ``make_samples`` spreads them over ``--depths``.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from vllm_sparse.eval.recall_run import RecallConfig, method_configs  # noqa: E402
from vllm_sparse.metadata.minmax_int8 import encode_minmax_int8  # noqa: E402

FORMATS = ("bf16", "int8_vec", "fp8_e4m3", "fp8_vec")
FP8_MAX = 448.0
PAGE_SIZE = 32  # Quest's GPU default (RecallConfig's page_size is 16)
STEPS = ("decode", "prefill")
BOOTSTRAP_REPS = 2000


def plane_bytes(fmt: str, d: int) -> int:
    """Bytes of the two planes of one (page, KV head) with ``d`` channels."""
    return {"bf16": 2 * d * 2, "int8_vec": 2 * d + 4, "fp8_e4m3": 2 * d, "fp8_vec": 2 * d + 4}[fmt]


# ---------------------------------------------------------------------------------------------- formats


def _scale(absmax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``float64 [..., 1]``: a float32 scale per row with ``absmax <= qmax * s`` exactly (``s = 1`` for 0)."""
    s = (absmax / qmax).float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    for _ in range(8):
        bad = absmax > qmax * s.double()  # exact: qmax has few bits, s is float32
        if not bad.any():
            return s.double()
        s = torch.where(bad, torch.nextafter(s, torch.full_like(s, math.inf)), s)
    raise AssertionError("scale did not settle")


def _fp8_step(codes: torch.Tensor, down: bool, mask: torch.Tensor) -> torch.Tensor:
    """``uint8`` e4m3fn codes moved one representable value down (``down``) or up where ``mask``."""
    mag, neg = codes & 0x7F, (codes & 0x80) != 0
    zero = mag == 0
    one = torch.ones_like(codes)
    if down:  # +x -> smaller magnitude, 0 -> smallest negative subnormal, -x -> larger magnitude
        new = torch.where(zero, torch.full_like(codes, 0x81), torch.where(neg, codes + one, codes - one))
    else:
        new = torch.where(zero, torch.full_like(codes, 0x01), torch.where(neg, codes - one, codes + one))
    return torch.where(mask, new, codes)


def _fp8_outward(x: torch.Tensor, s: torch.Tensor, down: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float64 code * s, bool overflow)``: the e4m3fn code of ``x / s`` rounded outward; entries
    beyond ``448 * s`` on the unbounded side are clamped to +-448 (``overflow``) and do not bound."""
    over = (x < -FP8_MAX * s) if down else (x > FP8_MAX * s)
    codes = (x / s).clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn).view(torch.uint8).clone()
    for _ in range(4):
        val = codes.view(torch.float8_e4m3fn).float().double() * s  # exact: 4 significant bits x float32
        bad = ((val > x) if down else (val < x)) & ~over
        if not bad.any():
            return val, over
        codes = _fp8_step(codes, down, bad)
    raise AssertionError("fp8 outward rounding did not settle")


def quantize_planes(fmt: str, kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The ``float32 [Hkv, P, D]`` planes ``fmt`` reads back for exact planes ``kmin, kmax``, and facts:
    ``planes_over_448`` (fp8: entries above 448 in magnitude), ``planes_unbounded`` (entries that no
    longer bound: clamped ones), ``slack`` (mean widening ``kmax' - kmax + kmin - kmin'`` per channel)."""
    lo64, hi64 = kmin.double(), kmax.double()
    n_over = n_unb = 0
    if fmt == "bf16":
        lo, hi = kmin.bfloat16().float(), kmax.bfloat16().float()
        assert torch.equal(lo, kmin) and torch.equal(hi, kmax), "planes of bf16 keys must be bf16 values"
        return lo, hi, {"planes_over_448": 0, "planes_unbounded": 0, "slack": 0.0}
    absmax = torch.maximum(lo64.abs(), hi64.abs()).amax(dim=-1, keepdim=True)  # [Hkv, P, 1]
    if fmt == "int8_vec":
        lo_codes, hi_codes, scale = encode_minmax_int8(kmin, kmax)  # the format the bounds kernels read
        s64 = scale.double()[..., None]  # (read back exactly in float64; decode_minmax_int8 rounds to float32)
        dlo, dhi = lo_codes.double() * s64, hi_codes.double() * s64
        assert bool((dlo <= lo64).all() and (dhi >= hi64).all()), "int8 planes do not bound"
        over_lo = over_hi = torch.zeros_like(lo64, dtype=torch.bool)
    elif fmt in ("fp8_e4m3", "fp8_vec"):
        s = torch.ones_like(absmax) if fmt == "fp8_e4m3" else _scale(absmax, FP8_MAX)
        (dlo, over_lo), (dhi, over_hi) = _fp8_outward(lo64, s, True), _fp8_outward(hi64, s, False)
        n_over = int((lo64.abs() > FP8_MAX).sum() + (hi64.abs() > FP8_MAX).sum()) if fmt == "fp8_e4m3" else 0
        n_unb = int(over_lo.sum() + over_hi.sum())
        assert fmt == "fp8_e4m3" or n_unb == 0, "a scaled fp8 plane cannot overflow"
    else:
        raise ValueError(f"unknown format {fmt!r}")
    lo, hi = dlo.float(), dhi.float()
    # bounds hold in float64 (asserted above) and after the float32 cast, except for clamped entries
    assert bool(((lo <= kmin) | over_lo).all()) and bool(((hi >= kmax) | over_hi).all()), f"{fmt} does not bound"
    ok = ~(over_lo | over_hi)  # widening of the entries that still bound
    slack = float(((dhi - hi64) + (lo64 - dlo))[ok].mean())
    return lo, hi, {"planes_over_448": n_over, "planes_unbounded": n_unb, "slack": slack}


# ---------------------------------------------------------------------------------------------- measure


def measure_step(config, layer: int, queries: torch.Tensor, keys: torch.Tensor, mass_fn, scale: float) -> list[dict]:
    """Records (one per format) of one (layer, step): ``queries [C, Hq, D]`` at positions ``S - C ..
    S - 1``, ``keys [S, Hkv, D]``; ``mass_fn()`` gives the step's dense ``PageMass`` (computed only
    when the plan is sparse). Empty when the plan runs dense (context below ``dense_below_tokens``)."""
    from vllm_sparse.eval.recall import covered, oracle_pages, selectable_share
    from vllm_sparse.eval.recall_select import page_views, request_plan, select
    from vllm_sparse.selectors.base import chunk_queries
    from vllm_sparse.selectors.quest import page_upper_bounds, reduce_and_pick

    c, s = queries.shape[0], keys.shape[0]
    hkv = keys.shape[1]
    plan = request_plan(config, layer, c, s, PAGE_SIZE)
    forced = plan.forced[plan.forced < plan.num_past_pages]
    if not plan.sparse or plan.num_select == 0:
        return []
    paged = page_views(keys, plan.num_past_pages, PAGE_SIZE)  # [Hkv, P, N, D]
    q = chunk_queries(queries, plan, config.query_window())
    k = plan.num_select
    kmin, kmax = paged.amin(dim=2), paged.amax(dim=2)  # [Hkv, P, D], exact bf16 values
    picks, facts = {}, {}
    for fmt in FORMATS:  # quest_pick's twin on each format's planes
        lo, hi, facts[fmt] = quantize_planes(fmt, kmin, kmax)
        picks[fmt] = reduce_and_pick(page_upper_bounds(q, lo, hi), forced, k, config.quest.gqa_reduce, scale)
    ref = select(config, layer, queries, keys, PAGE_SIZE, scale)  # self-check: bf16 is select()'s Quest
    assert torch.equal(torch.stack(ref.selected), picks["bf16"]), f"bf16 twin differs from select() at layer {layer}"
    mass = mass_fn()
    orc = covered(mass, forced, oracle_pages(mass, forced, [k] * hkv))  # same page counts for every format
    base = {
        "past_pages": plan.num_past_pages, "forced_pages": int(forced.numel()), "selected_pages": k,
        "plane_entries": 2 * kmin.numel(),
        "plane_absmax": round(float(torch.maximum(kmin.abs(), kmax.abs()).max()), 3),
        "oracle": round(float(orc.mean()), 6),
    }  # fmt: skip
    out = []
    for fmt in FORMATS:
        rec = covered(mass, forced, list(picks[fmt]))  # [Hkv, G]
        overlap = torch.stack([torch.isin(picks[fmt][h], picks["bf16"][h]).float() for h in range(hkv)])  # [Hkv, k]
        out.append({
            "format": fmt, **base,
            "recall": round(float(rec.mean()), 6),
            "selectable": round(float(selectable_share(mass, forced, rec).mean()), 6),
            "overlap": round(float(overlap.mean()), 6), "overlap_min": round(float(overlap.mean(dim=-1).min()), 6),
            "planes_over_448": facts[fmt]["planes_over_448"], "planes_unbounded": facts[fmt]["planes_unbounded"],
            "slack": round(facts[fmt]["slack"], 6),
        })  # fmt: skip
    return out


def measure_prompt(model, tokenizer, sample, config, chunk_size: int) -> tuple[dict, list[dict]]:
    """Capture one prompt and measure every layer that is not a dense layer; (prompt info, records)."""
    from functools import partial

    from tqdm.auto import tqdm

    from vllm_sparse.eval.capture import capture
    from vllm_sparse.eval.recall import dense_page_mass

    ids = tokenizer.encode(sample.prompt, add_special_tokens=False)
    t = len(ids)
    start = ((t - 1) // chunk_size) * chunk_size  # the last prefill chunk, as vLLM chunks
    t0 = time.perf_counter()
    cap = capture(model, ids, keep_from=start, chunk_size=chunk_size, cache_dtype=torch.bfloat16, progress=False)
    capture_s = time.perf_counter() - t0
    n = PAGE_SIZE
    records = []
    for layer in tqdm(range(len(cap.keys)), desc="layers", leave=False):
        policy = config.for_layer(layer)
        if policy.dense:  # dense_layers: no selection at all
            continue
        q, k = cap.queries[layer], cap.keys[layer]
        chunk_q, chunk_k = q[: t - start], k[:t]
        dec_q, dec_k = q[t - start :], k[: t + 1]
        steps = {
            "decode": (dec_q, dec_k, partial(dense_page_mass, dec_q, dec_k, t // n, n, cap.scale)),
            "prefill": (chunk_q, chunk_k, partial(dense_page_mass, chunk_q, chunk_k, start // n, n, cap.scale)),
        }
        for step, (sq, sk, mass_fn) in steps.items():
            engine_dense = step == "decode" and not policy.sparse_decode
            for r in measure_step(config, layer, sq, sk, mass_fn, cap.scale):
                records.append({"layer": layer, "step": step, "engine_dense": bool(engine_dense), **r})
    info = {
        "task": sample.task, "context": sample.context, "index": sample.index, "depth": sample.depth,
        "prompt_tokens": t, "last_chunk": [start, t], "first_token": tokenizer.decode([cap.decode_token]),
        "expected": list(sample.expected), "capture_s": round(capture_s, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    return info, records


# ---------------------------------------------------------------------------------------------- summary

SUBSETS = {
    "decode": ("decode, layers the engine decodes sparse", lambda r: r["step"] == "decode" and not r["engine_dense"]),
    "decode_all": ("decode, every measured layer (1-23)", lambda r: r["step"] == "decode"),
    "prefill": ("prefill chunk ranked by the bounds (1-23)", lambda r: r["step"] == "prefill"),
}


def _bootstrap_by_prompt(diffs: dict[int, list[float]], reps: int = BOOTSTRAP_REPS, seed: int = 0) -> list[float]:
    """95% percentile interval of the mean difference, prompts resampled with replacement (each with
    all its layers): the layers of one prompt are not independent, so this is the cautious interval."""
    keys = sorted(diffs)
    if len(keys) < 2:
        return [float("nan"), float("nan")]
    rng = random.Random(seed)
    means = []
    for _ in range(reps):
        pick = [rng.choice(keys) for _ in keys]
        vals = [x for p in pick for x in diffs[p]]
        means.append(math.fsum(vals) / len(vals))
    means.sort()
    return [means[int(0.025 * reps)], means[min(reps - 1, int(0.975 * reps))]]


def summarize(records: list[dict], d: int) -> list[dict]:
    """Per subset and format: means, the paired difference to bf16 (paired t over (prompt, layer)
    pairs, and a bootstrap over prompts), overlap with bf16's pages, fp8 overflow counts."""
    from vllm_sparse.eval.intervals import paired_difference

    out = []
    for subset, (label, pred) in SUBSETS.items():
        rows = [r for r in records if pred(r)]
        by = {}
        for r in rows:
            by.setdefault((r["prompt"], r["layer"]), {})[r["format"]] = r
        pairs = sorted(k for k, v in by.items() if "bf16" in v)
        if not pairs:
            continue
        for fmt in FORMATS:
            got = [(p, by[p][fmt], by[p]["bf16"]) for p in pairs if fmt in by[p]]
            rec = [a["recall"] for _, a, _ in got]
            ref = [b["recall"] for _, _, b in got]
            diff = paired_difference(rec, ref)
            per_prompt: dict[int, list[float]] = {}
            for (prompt, _), a, b in got:
                per_prompt.setdefault(prompt, []).append(a["recall"] - b["recall"])
            mean = lambda xs: math.fsum(xs) / len(xs)  # noqa: E731
            out.append({
                "subset": subset, "label": label, "format": fmt, "bytes": plane_bytes(fmt, d), "n": len(got),
                "prompts": len(per_prompt), "recall": mean(rec), "oracle": mean([a["oracle"] for _, a, _ in got]),
                "selectable": mean([a["selectable"] for _, a, _ in got]),
                "diff": diff.mean, "diff_t95": [diff.lo, diff.hi], "diff_boot95": _bootstrap_by_prompt(per_prompt),
                "diff_min": min(x - y for x, y in zip(rec, ref, strict=True)),
                "overlap": mean([a["overlap"] for _, a, _ in got]),
                "overlap_min": min(a["overlap"] for _, a, _ in got),
                "overlap_min_head": min(a["overlap_min"] for _, a, _ in got),
                "identical": mean([float(a["overlap"] == 1.0) for _, a, _ in got]),
                "slack": mean([a["slack"] for _, a, _ in got]),
                "planes_over_448": sum(a["planes_over_448"] for _, a, _ in got),
                "planes_unbounded": sum(a["planes_unbounded"] for _, a, _ in got),
                "plane_entries": sum(a["plane_entries"] for _, a, _ in got),
                "records_over_448": sum(a["planes_over_448"] > 0 for _, a, _ in got),
            })  # fmt: skip
    return out


def _f(x: float | None, fmt: str = "+.4f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def summary_table(summary: list[dict]) -> str:
    """The README's markdown table."""
    head = (
        "| step (layers) | format | bytes / (page, KV head) | pairs (prompts) | recall | diff to bf16 | 95% paired t "
        "| 95% bootstrap over prompts | overlap with bf16 pages | min overlap (record / KV head) | identical pages "
        "| fp8 entries > 448 |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for s in summary:
        over = f"{s['planes_over_448']} / {s['plane_entries']}" if s["format"] == "fp8_e4m3" else "-"
        lines.append(
            f"| {s['label']} | {s['format']} | {s['bytes']} | {s['n']} ({s['prompts']}) | {s['recall']:.4f} "
            f"| {_f(s['diff'])} | [{_f(s['diff_t95'][0])}, {_f(s['diff_t95'][1])}] "
            f"| [{_f(s['diff_boot95'][0])}, {_f(s['diff_boot95'][1])}] | {s['overlap']:.4f} "
            f"| {s['overlap_min']:.3f} / {s['overlap_min_head']:.3f} | {s['identical']:.3f} | {over} |"
        )
    return head + "\n".join(lines) + "\n"


def layer_table(records: list[dict], step: str) -> str:
    """Mean overlap with bf16's pages and mean recall difference per layer (one step)."""
    rows: dict[int, dict[str, list]] = {}
    ref = {(r["prompt"], r["layer"]): r["recall"] for r in records if r["step"] == step and r["format"] == "bf16"}
    for r in records:
        if r["step"] != step or r["format"] == "bf16":
            continue
        cell = rows.setdefault(r["layer"], {})
        cell.setdefault(r["format"], []).append((r["overlap"], r["recall"] - ref[(r["prompt"], r["layer"])]))
    fmts = [f for f in FORMATS if f != "bf16"]
    head = "| layer | " + " | ".join(f"{f} overlap / recall diff" for f in fmts) + " |\n"
    head += "|---|" + "---|" * len(fmts) + "\n"
    body = []
    for layer in sorted(rows):
        cells = []
        for f in fmts:
            xs = rows[layer].get(f, [])
            ov = math.fsum(x for x, _ in xs) / len(xs) if xs else float("nan")
            dd = math.fsum(y for _, y in xs) / len(xs) if xs else float("nan")
            cells.append(f"{ov:.3f} / {dd:+.4f}")
        eng = next((r["engine_dense"] for r in records if r["layer"] == layer and r["step"] == step), False)
        body.append(f"| {layer}{' (engine decodes dense)' if eng else ''} | " + " | ".join(cells) + " |")
    return head + "\n".join(body) + "\n"


def write_readme(result: dict, out: Path) -> None:
    """``out/README.md``: what was measured and the summary table (findings are added by hand below
    the generated part)."""
    cfg, m = result["config"], result["machine"]
    prompts = result["prompts"]
    d = cfg["head_dim"]
    by_task: dict[str, int] = {}
    for p in prompts:
        by_task[p["task"]] = by_task.get(p["task"], 0) + 1
    fp8 = [s for s in result["summary"] if s["format"] == "fp8_e4m3"]
    text = f"""# Quest's key min/max planes in fewer bytes: selection on Qwen2.5-Coder-0.5B-Instruct (CPU)

Generated by `benchmarks/minmax_precision_cpu.py` (its docstring says how each format is built):

    {result["command"]}

Machine: {m.get("cpu")}, {m.get("cores")} cores, torch {m.get("torch")}; {result["seconds"] / 60:.1f} minutes.
Model: `{result["model"]}` (real weights, bf16 on the CPU), D = {d}, {cfg["num_kv_heads"]} KV heads,
{cfg["num_q_heads"]} query heads, {cfg["num_layers"]} layers. Prompts: {len(prompts)}
({", ".join(f"{k} {v}" for k, v in by_task.items())}) at {", ".join(str(c) for c in cfg["contexts"])} tokens,
depths {cfg["depths"]}, seed {cfg["seed"]}. Shipped config `{cfg["sparse_config_file"]}`: budget
{cfg["budget_fraction"]:g} of the context, sink {cfg["sink_tokens"]}, local {cfg["local_tokens"]} tokens,
`gqa_reduce: {cfg["gqa_reduce"]}`, query window {cfg["query_window"]}; pages of {cfg["page_size"]},
prefill chunks of {cfg["chunk_size"]}.

Per (prompt, layer, step) each format's Quest pages are picked from its planes (outward-rounded, so
they still bound the keys; asserted) with the same queries, forced pages and page count; `bf16` is
asserted to be `eval/recall_select.select`'s Quest selection at every (layer, step). Recall is the
dense attention mass the forced + selected pages (and the step's own pages) cover, mean over query
heads (`eval/recall.py`); the oracle at the same page counts covers {_oracle_line(result)}.

* **diff to bf16**: the format's recall minus bf16's on the same (prompt, layer); the 95% paired-t
  interval treats the (prompt, layer) pairs as independent (they are not: layers of a prompt share the
  prompt), the bootstrap resamples whole prompts ({BOOTSTRAP_REPS} resamples, percentile interval).
* **overlap**: the share of bf16's selected pages the format also selects (mean over KV heads, then
  over records); min overlap: the lowest record's mean over heads / the lowest single KV head.
* **identical pages**: the share of records where the format selects exactly bf16's pages.
* **fp8 entries > 448**: plane entries of magnitude above 448 (e4m3fn's largest value) over all
  plane entries; {_fp8_line(fp8)}

Steps: `decode` is the first decode token (one query); the engine decodes layers 6-11 dense under the
shipped config, so the first rows leave them out and the second rows add them. `prefill` is the
prompt's last chunk ranked by the bounds (max over its last {cfg["query_window"]} queries), recall
over every query of the chunk; the shipped config ranks Quest chunks by exact scores
(`quest.prefill_scores: exact`), so these rows stand for `prefill_scores: bounds`. Layer 0 (a dense
layer) is not measured.

## Summary

{summary_table(result["summary"])}
## Per layer, decode (mean overlap with bf16's pages / mean recall difference)

{layer_table(result["records"], "decode")}
## Per layer, prefill chunk

{layer_table(result["records"], "prefill")}"""
    (out / "README.md").write_text(text)


def _oracle_line(result: dict) -> str:
    parts = [f"{s['oracle']:.4f} ({s['subset']})" for s in result["summary"] if s["format"] == "bf16"]
    return ", ".join(parts) or "-"


def _fp8_line(fp8: list[dict]) -> str:
    if not fp8:
        return "none measured."
    s = max(fp8, key=lambda x: x["plane_entries"])
    if s["planes_over_448"] == 0:
        return "none exceeded 448 in this run, so every fp8 plane bounds its keys."
    return (
        f"{s['planes_over_448']} of {s['plane_entries']} in `{s['subset']}`; {s['planes_unbounded']} of them no "
        "longer bound (clamped to +-448 for the selection)."
    )


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    import yaml
    from tqdm.auto import tqdm

    from vllm_sparse.config import match_shipped_config
    from vllm_sparse.eval.capture import load_model
    from vllm_sparse.eval.models import resolve_model
    from vllm_sparse.eval.report import machine_info
    from vllm_sparse.eval.tasks import make_samples

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192])
    ap.add_argument("--tasks", nargs="+", default=["niah_single", "niah_multikey", "vt"])
    ap.add_argument("--samples", type=int, default=2, help="prompts per (task, context), spread over --depths")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompts", type=int, default=None, help="measure only the first N prompts (smoke runs)")
    ap.add_argument("--model", default=RecallConfig.model)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    script = os.path.relpath(Path(__file__).resolve(), Path.cwd())
    command = "python " + shlex.join([script, *(sys.argv[1:] if argv is None else argv)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    path = resolve_model(args.model, progress=False)
    yaml_path = match_shipped_config(args.model)[0]
    base = yaml.safe_load(yaml_path.read_text())
    fraction = base.get("budget", {}).get("fraction", 0.25)
    rc = RecallConfig(model=args.model, methods=(), budgets=(fraction,), page_size=PAGE_SIZE,
                      variants={"quest": ("quest", {"quest": {"prefill_scores": "bounds"}})})  # fmt: skip
    config = method_configs(rc, base)[(fraction, "quest")]
    model, tokenizer = load_model(path, torch.bfloat16)
    mc = model.config
    d = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    samples = [s for ctx in args.contexts for task in args.tasks
               for s in make_samples(tokenizer, task, ctx, args.samples, args.depths, args.seed)]  # fmt: skip
    samples = samples[: args.max_prompts] if args.max_prompts else samples
    policy = config.for_layer(1)
    cfg = {
        **vars(args), "contexts": args.contexts, "page_size": PAGE_SIZE, "chunk_size": rc.chunk_size,
        "sparse_config_file": yaml_path.name, "sparse_config": base, "budget_fraction": fraction,
        "prefill_scores": config.quest_prefill_scores(), "gqa_reduce": config.quest.gqa_reduce,
        "query_window": config.query_window(), "sink_tokens": policy.sink_tokens, "local_tokens": policy.local_tokens,
        "head_dim": d, "num_kv_heads": mc.num_key_value_heads, "num_q_heads": mc.num_attention_heads,
        "num_layers": mc.num_hidden_layers, "formats": list(FORMATS),
        "bytes_per_page_kv_head": {f: plane_bytes(f, d) for f in FORMATS},
    }  # fmt: skip
    prompts, records = [], []
    result: dict[str, Any] = {}
    for i, sample in enumerate(tqdm(samples, desc="prompts")):
        info, recs = measure_prompt(model, tokenizer, sample, config, rc.chunk_size)
        prompts.append(info)
        records += [{"prompt": i, "task": sample.task, "context": sample.context, **r} for r in recs]
        result = {
            "command": command, "model": args.model, "model_path": path, "machine": machine_info(), "config": cfg,
            "prompts": prompts, "summary": summarize(records, d), "seconds": round(time.perf_counter() - t0, 1),
            "complete": i + 1 == len(samples), "records": records,
        }  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)  # (again: the folder may have been removed meanwhile)
        (out / "minmax_precision.json").write_text(json.dumps(result, indent=1))  # after every prompt
        print(f"prompt {i + 1}/{len(samples)} {sample.task} depth {sample.depth}: {info['seconds']} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    write_readme(result, out)
    print(summary_table(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
