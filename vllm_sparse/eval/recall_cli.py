"""``vllm-sparse recall``: the argparse wiring of the attention-recall measure (``eval/recall_run.py``)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from vllm_sparse.config import METHODS
from vllm_sparse.eval.tasks import TASKS


def _variant(text: str) -> tuple[str, tuple[str, dict]]:
    """``NAME=METHOD:JSON`` -> ``(NAME, (METHOD, fields))``."""
    try:
        name, rest = text.split("=", 1)
        method, fields = rest.split(":", 1)
        return name, (method, json.loads(fields))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected NAME=METHOD:JSON, got {text!r} ({e})") from e


def add_recall_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``recall`` on the ``vllm-sparse`` sub-command parsers; returns the new parser."""
    from vllm_sparse.eval.recall_run import RecallConfig

    d = RecallConfig()
    p = subparsers.add_parser(
        "recall",
        help="share of dense attention mass each selector's pages cover, per layer (CPU, transformers)",
        description="Capture a model's post-RoPE queries and keys on the eval tasks' prompts (chunked prefill, "
        "then --decode-steps greedy decode steps) and measure, per layer, budget and method, the dense attention mass on the pages "
        "the selector attends beside the oracle's at the same page count; write recall.json, tables.md and "
        "PNG plots into --out.",
    )
    p.add_argument("--model", default=d.model, help="known model name or local HF folder; NAME@yarnF: YaRN-scaled by F")
    p.add_argument("--tasks", nargs="+", default=list(d.tasks), choices=list(TASKS), metavar="TASK")
    p.add_argument("--contexts", nargs="+", type=int, default=list(d.contexts))
    p.add_argument("--samples", type=int, default=d.samples, help="prompts per task and context")
    p.add_argument("--depths", nargs="+", type=float, default=list(d.depths))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--methods", nargs="+", default=list(d.methods), choices=METHODS, metavar="METHOD",
                   help=f"selectors to measure, of {', '.join(METHODS)} (kascade: the anchor layers and head "
                   "maps of the config's kascade field, e.g. calibrated ones or {anchors: evenly_spaced})")  # fmt: skip
    p.add_argument("--variant", action="append", type=_variant, default=[], metavar="NAME=METHOD:JSON",
                   help="a further method with extra sparse_attention fields, e.g. "
                   "'quoka_w64=quoka:{\"chunk_query_window\": 64}' or "
                   "'kascade_w64=kascade:{\"chunk_query_window\": 64}' (repeatable)")  # fmt: skip
    p.add_argument("--budgets", nargs="+", type=float, default=list(d.budgets))
    p.add_argument("--decode-steps", type=int, default=d.decode_steps,
                   help="greedy answer tokens to measure at decode (1: the first; more add the decode_answer phase)")  # fmt: skip
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--sparse-config", default=None, help="selector YAML (default: the shipped one for the model)")
    p.add_argument("--out", default=d.out_dir)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=run_recall_command)
    return p


def run_recall_command(args: argparse.Namespace) -> int:
    """Run the measure; prints the tables."""
    import torch

    from vllm_sparse.eval.recall_run import RecallConfig, run_recall

    argv = sys.argv[1:] if sys.argv[1:2] == ["recall"] else ["recall", *sys.argv[1:]]
    cfg = RecallConfig(
        model=args.model, tasks=tuple(args.tasks), contexts=tuple(args.contexts), samples=args.samples,
        depths=tuple(args.depths), seed=args.seed, methods=tuple(args.methods), variants=dict(args.variant),
        budgets=tuple(args.budgets), decode_steps=args.decode_steps, page_size=args.page_size, chunk_size=args.chunk_size, dtype=args.dtype,
        sparse_config=args.sparse_config, out_dir=args.out, progress=not args.no_progress,
        command=" ".join(shlex.quote(a) for a in ["vllm-sparse", *argv]),
    )  # fmt: skip
    with torch.no_grad():
        result = run_recall(cfg)
    from vllm_sparse.eval.recall_report import tables

    print(tables(result))
    return 0
