"""Paired accuracy difference of a config variant against its base, on the same prompts, from eval run folders.

Pairs each sparse backend of the variant run with the base run's backend of the same label, or, for a label
with a ``+VARIANT`` suffix (``eval_gpu_parallel.py --variant``), with the label without it; samples pair by
prompt (``cells.paired_table``), so the two runs may hold different task and context sets, and only the
cells both ran count::

    python benchmarks/eval_pair_variants.py --base RUN_A --variant RUN_B --out pairs.json

``--pair VARIANT_LABEL=BASE_LABEL`` (repeatable) names the pairs instead (``sparse_quoka@0.25+d7sd=sparse_quoka@0.25+sd``).

Writes the rows as JSON (per backend, task and context, and over all tasks of a context: mean difference,
samples, 95% paired-t interval) and prints them as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from vllm_sparse.eval.cells import ALL, paired_table


def _records(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "samples.json").read_text())


def default_pairs(base_labels: set[str], variant_labels: list[str], same_run: bool = False) -> list[tuple[str, str]]:
    """(variant label, base label) for every sparse variant label that has a base (in one run, only
    ``+VARIANT`` labels: a label against itself there says nothing)."""
    pairs = []
    for label in variant_labels:
        if not label.startswith("sparse_"):
            continue
        stem = label.split("+", 1)[0]
        if stem != label and stem in base_labels:
            pairs.append((label, stem))
        elif stem == label and label in base_labels and not same_run:
            pairs.append((label, label))
    return pairs


def pair_rows(base: list[dict], variant: list[dict], pairs: list[tuple[str, str]]) -> list[dict]:
    """One row per (pair, task, context): the variant's score minus the base's on the same prompts."""
    rows = []
    for var_label, base_label in pairs:
        records = [{**r, "backend": "base"} for r in base if r["backend"] == base_label]
        records += [{**r, "backend": "variant"} for r in variant if r["backend"] == var_label]
        for (_, task, context), (diff, unpaired) in sorted(
            paired_table(records, "base").items(), key=lambda kv: (kv[0][2], kv[0][1] == ALL, kv[0][1])
        ):
            if diff.n == 0:
                continue
            rows.append({
                "variant": var_label, "base": base_label, "task": "all tasks" if task == ALL else task,
                "context": context, "difference": round(diff.mean, 4), "n": diff.n, "unpaired": unpaired,
                "ci95": None if diff.lo is None else [round(diff.lo, 4), round(diff.hi, 4)],
            })  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| variant | base | context | task | difference [95% paired-t] | n |", "|---|---|---|---|---|---|"]
    for r in rows:
        ci = "" if r["ci95"] is None else f" [{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}]"
        bold = "**" if r["ci95"] and (r["ci95"][0] > 0 or r["ci95"][1] < 0) else ""
        task = f"**{r['task']}**" if r["task"] == "all tasks" else r["task"]
        lines.append(
            f"| {r['variant']} | {r['base']} | {r['context']} | {task} | {bold}{r['difference']:+.2f}{ci}{bold} | {r['n']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="run folder with the base backends")
    p.add_argument("--variant", type=Path, required=True, help="run folder with the variant backends (may be --base)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--pair", action="append", default=[], metavar="VARIANT=BASE",
                   help="pair these labels (repeatable) instead of the default pairs")  # fmt: skip
    args = p.parse_args(argv)
    base, variant = _records(args.base), _records(args.variant)
    labels = list(dict.fromkeys(r["backend"] for r in variant))
    same_run = args.base.resolve() == args.variant.resolve()
    pairs = [tuple(p.split("=", 1)) for p in args.pair] or default_pairs({r["backend"] for r in base}, labels, same_run)
    if not pairs:
        print("no variant label has a base label to pair with", file=sys.stderr)
        return 2
    rows = pair_rows(base, variant, pairs)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/eval_pair_variants.py", *(argv or sys.argv[1:])])
    args.out.write_text(json.dumps({"command": command, "base": str(args.base), "variant": str(args.variant),
                                    "rows": rows}, indent=1) + "\n")  # fmt: skip
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
