"""``vllm-sparse eval``: the argparse wiring of the accuracy evaluation (see ``eval/runner.py``)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from vllm_sparse.eval.tasks import DEFAULT_DEPTHS, TASKS


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval`` on the ``vllm-sparse`` sub-command parsers; returns the new parser."""
    p = subparsers.add_parser(
        "eval",
        help="accuracy of dense vs sparse backends on NIAH/RULER-style tasks",
        description="Run seeded long-context tasks through vLLM with the dense backend and every sparse "
        "method at each budget (one engine per backend); write samples.json, summary.json, report.md and "
        "PNG plots into --out.",
    )
    p.add_argument(
        "--model",
        default="qwen2.5-coder-0.5b-instruct",
        help="known model name or local HF folder; NAME@yarnF: with YaRN RoPE scaling by F (eval.rope_variant)",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        default=list(TASKS),
        choices=list(TASKS),
        metavar="TASK",
        help=f"tasks (default: all): {', '.join(TASKS)}",
    )
    p.add_argument("--contexts", nargs="+", type=int, default=[4096], help="context lengths in tokens")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per task and context (default: 20 with a GPU, enough for the 95%% intervals the report "
        "gives; 2 on CPU, where each sample costs a minute per backend: use 20 for runs you record)",
    )
    p.add_argument("--depths", nargs="+", type=float, default=list(DEFAULT_DEPTHS), help="needle depths in [0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", default=None, help="sparse methods (default: every implemented one)")
    p.add_argument("--budgets", nargs="+", type=float, default=[0.125, 0.25], help="budget fractions")
    p.add_argument(
        "--min-tokens",
        type=int,
        default=None,
        help="budget min_tokens of every sparse backend (default: the --sparse-config's or the model config's)",
    )
    p.add_argument(
        "--sparse-config",
        default=None,
        help="JSON of further sparse_attention fields for every sparse backend, e.g. '{\"dense_below_tokens\": 1024}'",
    )
    p.add_argument("--dense-backend", default=None, help="dense backend (default: CPU_ATTN on CPU, FLASH_ATTN on GPU)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache memory per engine (GiB)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="vLLM's share of the accelerator each engine may take (lower it to run evals side by side)",
    )
    p.add_argument(
        "--sparse-only",
        action="store_true",
        help="run only the sparse backends, no dense engine; join the folder to a run on the same prompts that "
        "has dense with `python -m vllm_sparse.eval.join OUT MAIN THIS`",
    )
    p.add_argument(
        "--label-suffix",
        default="",
        help="appended to every sparse backend's label (sparse_quoka@0.25+tail64), to tell runs of a variant apart",
    )
    p.add_argument("--out", default="eval_results", help="output folder")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=run_eval_command)
    return p  # fmt: skip


def _command() -> str:
    """This process's command line as ``vllm-sparse eval ...`` (for the report)."""
    argv = sys.argv[1:] if sys.argv[1:2] == ["eval"] else ["eval", *sys.argv[1:]]
    return " ".join(shlex.quote(a) for a in ["vllm-sparse", *argv])


def config_from_args(args: argparse.Namespace):
    """An :class:`EvalConfig` from parsed arguments."""
    from vllm_sparse.eval.runner import Backend, EvalConfig, default_backends, default_samples

    extra = json.loads(args.sparse_config) if args.sparse_config else None
    backends = default_backends(args.methods, args.budgets, args.min_tokens, extra, args.dense_backend)
    if args.sparse_only:
        backends = [b for b in backends if b.is_sparse]
    if args.label_suffix:
        backends = [Backend(b.label + args.label_suffix, b.name, b.sparse) if b.is_sparse else b for b in backends]
    return EvalConfig(
        model=args.model, tasks=tuple(args.tasks), contexts=tuple(args.contexts),
        samples=args.samples if args.samples is not None else default_samples(),
        depths=tuple(args.depths), seed=args.seed, backends=backends, dtype=args.dtype,
        block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
        gpu_memory_utilization=args.gpu_memory_utilization, sparse_only=args.sparse_only,
        out_dir=args.out, progress=not args.no_progress,
        command=_command(),
    )  # fmt: skip


def run_eval_command(args: argparse.Namespace) -> int:
    """Run the evaluation; prints the markdown table. Exit code 2 for a bad model, context or config."""
    from vllm_sparse.eval.models import UnknownModelError
    from vllm_sparse.eval.runner import run_eval

    try:
        config = config_from_args(args)
        result = run_eval(config)
    except (UnknownModelError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.markdown)
    print("\n".join(f"wrote {path}" for path in result.files.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_sparse.eval.cli ...``: the same command without the lead's ``vllm-sparse`` wrapper."""
    parser = argparse.ArgumentParser(prog="vllm-sparse")
    add_eval_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["eval", *(argv if argv is not None else sys.argv[1:])])
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
