"""Run one accuracy eval as several `vllm-sparse eval` processes side by side on one GPU, then join them.

An eval in eager mode keeps a GPU mostly idle (a small model, host work per layer), so the backends are split
into groups that run at the same time, each its own process and engine, on the same prompts (the same seed,
tasks, contexts and samples). The first group also runs the dense backend; the others run sparse only. The
folders are then joined into one report (``vllm_sparse.eval.join``: prompt hashes checked, paired
differences against the first group's dense run)::

    python benchmarks/eval_gpu_parallel.py OUT --groups quoka:0.125 quoka:0.25 quest:0.125,0.25 \\
        -- --model qwen2.5-coder-1.5b-instruct --tasks niah_single vt --contexts 8192 16384 --samples 20

A group is ``METHOD[,METHOD...]:BUDGET[,BUDGET...]``, optionally ``+VARIANT`` for a variant declared with
``--variant VARIANT JSON``: its fields are merged into the group's ``--sparse-config`` and its labels get
``+VARIANT`` (``sparse_quoka@0.25+tail64``). Everything after ``--`` goes to every process's
``vllm-sparse eval`` (``--methods``, ``--budgets``, ``--out``, ``--sparse-only`` and ``--label-suffix`` are set
here). Each group
writes ``OUT/gNN/`` and ``OUT/gNN.log``; the joined report is ``OUT/joined/``. Choose
``--gpu-memory-utilization`` and ``--kv-cache-gib`` so that every group's engine fits at once.

``--gpus 0 1 2`` spreads the groups over several GPUs of one host: group ``i`` runs on GPU ``gpus[i % len]``
(its ``CUDA_VISIBLE_DEVICES``), so naming a GPU twice gives it twice the groups.

``--dense-from RUN`` reuses the dense run of an earlier eval of the same prompts (same model, tasks,
contexts, samples and seed; a folder of this script's ``gNN`` or ``joined`` kind): every group then runs
sparse only, and the join pairs them with ``RUN``'s dense alone (prompt hashes checked; its sparse runs are left
out, so the same backends can run again), which saves the dense engine, the slowest of a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vllm_sparse.eval.join import join_runs


def parse_group(text: str) -> tuple[list[str], list[str], str]:
    """``quoka,quest:0.125,0.25+tail64`` -> (["quoka", "quest"], ["0.125", "0.25"], "tail64")."""
    body, _, variant = text.partition("+")
    methods, sep, budgets = body.partition(":")
    if not sep or not methods or not budgets:
        raise argparse.ArgumentTypeError(f"group {text!r}: expected METHOD[,METHOD...]:BUDGET[,BUDGET...][+VARIANT]")
    for b in budgets.split(","):
        float(b)
    return methods.split(","), budgets.split(","), variant


def with_variant(eval_args: list[str], fields: dict) -> list[str]:
    """``eval_args`` with ``fields`` merged into its ``--sparse-config`` JSON (added if absent)."""
    if not fields:
        return list(eval_args)
    args = list(eval_args)
    if "--sparse-config" in args:
        i = args.index("--sparse-config") + 1
        args[i] = json.dumps({**json.loads(args[i]), **fields})
        return args
    return [*args, "--sparse-config", json.dumps(fields)]


def group_command(index: int, group: tuple[list[str], list[str], str], out: Path, eval_args: list[str],
                  variants: dict[str, dict], with_dense: bool = True) -> list[str]:  # fmt: skip
    """The ``vllm-sparse eval`` command of group ``index`` (group 0 runs dense too, unless not
    ``with_dense``: the dense run comes from an earlier eval)."""
    methods, budgets, variant = group
    if variant and variant not in variants:
        raise SystemExit(f"group variant {variant!r} is not declared with --variant")
    args = with_variant(eval_args, variants.get(variant, {}))
    cmd = [sys.executable, "-m", "vllm_sparse.eval.cli", *args, "--methods", *methods, "--budgets", *budgets]
    cmd += ["--out", str(out / f"g{index:02d}"), "--no-progress"]
    if variant:
        cmd += ["--label-suffix", f"+{variant}"]
    return cmd if index == 0 and with_dense else [*cmd, "--sparse-only"]


def group_env(index: int, gpus: list[str] | None) -> dict[str, str] | None:
    """The environment of group ``index``: this process's, with ``CUDA_VISIBLE_DEVICES`` set to its GPU when
    ``gpus`` is given (round robin), else ``None`` (inherit)."""
    if not gpus:
        return None
    return {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[index % len(gpus)]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, eval_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--groups", nargs="+", type=parse_group, required=True)
    p.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "JSON"),
                   help="a named sparse_attention variant for groups written METHOD:BUDGET+NAME")  # fmt: skip
    p.add_argument("--stagger-s", type=float, default=5.0, help="seconds between process starts")
    p.add_argument("--dense-from", type=Path, default=None,
                   help="an earlier eval of the same prompts whose dense run the groups are joined with "
                   "(every group then runs sparse only)")  # fmt: skip
    p.add_argument("--gpus", nargs="+", default=None, metavar="GPU",
                   help="CUDA devices to spread the groups over, round robin (default: the ones this process sees)")  # fmt: skip
    args = p.parse_args(ours)
    variants = {name: json.loads(fields) for name, fields in args.variant}
    args.out.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, group in enumerate(args.groups):
        cmd = group_command(i, group, args.out, eval_args, variants, with_dense=args.dense_from is None)
        log = open(args.out / f"g{i:02d}.log", "w")  # noqa: SIM115 (closed below)
        log.write(" ".join(cmd) + "\n")
        log.flush()
        env = group_env(i, args.gpus)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append((i, proc, log, time.perf_counter()))
        where = f" on GPU {env['CUDA_VISIBLE_DEVICES']}" if env else ""
        print(f"group {i}: {group[0]} at {group[1]} started{where}", flush=True)
        time.sleep(args.stagger_s)
    failed = []
    for i, proc, log, started in procs:
        rc = proc.wait()
        log.close()
        print(f"group {i}: exit {rc} after {time.perf_counter() - started:.0f} s", flush=True)
        if rc != 0:
            failed.append(i)
    done = [
        args.out / f"g{i:02d}"
        for i, *_ in procs
        if i not in failed and (args.out / f"g{i:02d}" / "samples.json").exists()
    ]
    if args.dense_from is None and (0 in failed or not done or done[0].name != "g00"):
        print("the dense group failed: nothing to join", flush=True)
        return 1
    if not done:
        print("every group failed: nothing to join", flush=True)
        return 1
    runs = done if args.dense_from is None else [args.dense_from, *done]
    # an earlier eval's folder may hold runs of these very backends beside its dense one: only its dense is reused
    join_runs(args.out / "joined", *runs, allow_dense_mismatch=True, dense_only=args.dense_from is not None)
    print(f"joined {len(done)} groups into {args.out / 'joined'}; failed groups: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
