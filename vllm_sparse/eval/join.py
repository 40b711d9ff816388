"""Join eval runs made on the same prompts (for example in parallel, one engine group per process) into one report.

Each run folder holds the ``samples.json`` and ``summary.json`` that ``vllm-sparse eval`` wrote. The first
folder is the main run and must contain a dense backend: its dense results are the reference for every
paired difference. A later folder contributes each backend whose label the joined run does not have yet, after
its prompts are checked to be the same (prompt hashes, in order). A later folder's own dense run is not
added again; it is compared output by output with the main one, and the joined ``summary.json`` records how
many outputs agree (``dense_reruns``): greedy dense decoding of the same prompts is expected to agree, so a
disagreement says the runs are not comparable, and the join refuses unless ``allow_dense_mismatch``.

The joined report keeps the machine of the main run (the machine that measured, not the one joining)::

    python -m vllm_sparse.eval.join OUT_DIR MAIN_DIR OTHER_DIR [OTHER_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from vllm_sparse.eval.report import load_result, write_report


class JoinError(ValueError):
    """The runs cannot be joined (other prompts, no dense run, dense outputs that disagree)."""


def _hashes(run) -> list[str]:
    return [r["prompt_hash"] for r in run.records]


def _dense(result):
    return next((r for r in result.runs if not r.backend.is_sparse), None)


def join_runs(out_dir: str | Path, main_dir: str | Path, *other_dirs: str | Path,
              allow_dense_mismatch: bool = False, command: str | None = None, dense_only: bool = False):  # fmt: skip
    """Join ``other_dirs``' backends into ``main_dir``'s run and write the joined files into ``out_dir``.

    ``dense_only``: take only ``main_dir``'s dense run (its sparse runs are left out), as where an earlier eval's
    dense reference is reused for new runs of the same backends (``eval_gpu_parallel.py --dense-from``).

    Returns the joined result (``vllm_sparse.eval.runner.EvalResult``).

    Raises:
        JoinError: ``main_dir`` has no dense run; a run's prompts differ from the main run's; or a later
            dense run's outputs differ from the main one's (unless ``allow_dense_mismatch``).
    """
    main = load_result(main_dir)
    main_summary = json.loads((Path(main_dir) / "summary.json").read_text())
    dense = _dense(main)
    if dense is None:
        raise JoinError(f"{main_dir}: no dense run; the first folder must hold the dense reference")
    if dense_only:
        main.runs = [dense]
    reference = _hashes(dense)
    reruns: list[dict[str, Any]] = []
    commands = [main.config.command]
    for other_dir in other_dirs:
        other = load_result(other_dir)
        commands.append(other.config.command)
        have = {r.backend.label for r in main.runs}
        for run in other.runs:
            if _hashes(run) != reference:
                raise JoinError(f"{other_dir}: {run.backend.label} ran other prompts than {main_dir}")
            if not run.backend.is_sparse:
                same = sum(a["output"] == b["output"] for a, b in zip(dense.records, run.records, strict=True))
                reruns.append({"dir": str(other_dir), "label": run.backend.label, "same_outputs": same,
                               "outputs": len(run.records)})  # fmt: skip
                if same != len(run.records) and not allow_dense_mismatch:
                    raise JoinError(
                        f"{other_dir}: its dense run agrees with {main_dir}'s on {same} of {len(run.records)} "
                        "outputs; greedy dense runs of the same prompts should agree (allow_dense_mismatch to join)"
                    )
            elif run.backend.label in have:
                raise JoinError(f"{other_dir}: backend {run.backend.label} is already in the joined run")
            else:
                main.runs.append(run)
    main.config.backends = [r.backend for r in main.runs]
    main.config.out_dir = str(out_dir)
    joined = command or "python -m vllm_sparse.eval.join " + " ".join(
        [shlex.quote(str(p)) for p in (out_dir, main_dir, *other_dirs)] + (["--dense-only"] if dense_only else [])
    )
    main.config.command = "; ".join(c for c in [*commands, joined] if c)
    write_report(main, machine=main_summary["machine"], extra={"dense_reruns": reruns})
    return main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_sparse.eval.join", description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder for the joined files")
    p.add_argument("main", help="the run with the dense reference")
    p.add_argument("others", nargs="+", help="runs on the same prompts whose backends are added")
    p.add_argument("--allow-dense-mismatch", action="store_true")
    p.add_argument("--dense-only", action="store_true", help="take only the main run's dense backend")
    args = p.parse_args(argv)
    try:
        result = join_runs(
            args.out, args.main, *args.others, allow_dense_mismatch=args.allow_dense_mismatch, dense_only=args.dense_only
        )
    except JoinError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
