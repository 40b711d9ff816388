"""``chunk_query_window`` 0 against 64 for QuoKA, Quest and Kascade under a shipped config, on CPU, beside dense
(and Kascade's ``kascade.tile_stride`` variants with ``--strides``).

Every sparse backend loads the shipped YAML (``--config``, default Qwen2.5-Coder-0.5B-Instruct's) and sets
only ``chunk_query_window``: 0 (every query of a prefill chunk scores the pages) or 64 (its last 64 queries,
which in the prompt's last chunk are the question and the answer prefix). Twilight runs at its default as a
check. One engine per backend, the same prompts for all of them, so the report's paired differences apply.

    python benchmarks/eval_query_window_cpu.py OUT_DIR [--tasks niah_single] [--contexts 8192 16384] [--samples 6]

On a shared machine the backends can be split over two processes: ``--only LABEL ...`` runs just those
backends, in that order, on the same prompts (without ``CPU_ATTN`` among them, no dense engine) into their own OUT_DIR, and ``--join MAIN_DIR EXTRA_DIR``
adds that folder's backends to a run that has dense and writes the report again (paired differences included).
"""

import argparse
import shlex
import sys
from pathlib import Path

import yaml

from vllm_sparse.eval.join import join_runs
from vllm_sparse.eval.runner import Backend, EvalConfig, run_eval

SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "qwen2.5-coder-0.5b-instruct.yaml"


def backends(config: Path, windows: list[int], tails: list[int] = (), strides: list[int] = ()) -> list[Backend]:
    """Dense, then QuoKA, Quest and Kascade at each window, then Twilight and compact at their defaults, then each method at
    its default window with each ``dense_tail_tokens`` of ``tails`` (labels ``quoka_tail64``, ...), then Kascade at
    each ``kascade.tile_stride`` of ``strides`` (labels ``kascade_s8``, ...: its anchors score a prefill chunk's
    last tile and every S-th before it)."""
    budget = yaml.safe_load(config.read_text()).get("budget", {})
    base = {"config": str(config), "budget": budget}  # budget repeated so the report shows the shipped one
    out = [Backend("CPU_ATTN", "CPU_ATTN")]
    for method in ("quoka", "quest", "kascade"):
        out += [Backend(f"{method}_w{w}", f"sparse_{method}", {**base, "chunk_query_window": w}) for w in windows]
    out.append(Backend("twilight_default", "sparse_twilight", base))
    out.append(Backend("compact_default", "sparse_compact", base))  # no budget: its alpha decides
    for method in ("quoka", "quest", "twilight"):
        out += [Backend(f"{method}_tail{t}", f"sparse_{method}", {**base, "dense_tail_tokens": t}) for t in tails]
    out += [Backend(f"kascade_s{s}", "sparse_kascade", {**base, "kascade": {"tile_stride": s}}) for s in strides]
    return out


def join(main_dir: str, extra_dir: str) -> None:
    """Add ``extra_dir``'s backends (same prompts, checked by hash) to ``main_dir``'s run and re-render it."""
    join_runs(main_dir, main_dir, extra_dir, command=f"python {sys.argv[0]} --join {main_dir} {extra_dir}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--join"]:
        sys.exit(join(*sys.argv[2:4]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--config", type=Path, default=SHIPPED)
    p.add_argument("--tasks", nargs="+", default=["niah_single"])
    p.add_argument("--contexts", nargs="+", type=int, default=[8192, 16384])
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--windows", nargs="+", type=int, default=[0, 64])
    p.add_argument("--tails", nargs="+", type=int, default=[], help="dense_tail_tokens variants (METHOD_tailN)")
    p.add_argument("--strides", nargs="+", type=int, default=[], help="kascade.tile_stride variants (kascade_sN)")
    p.add_argument(
        "--only", nargs="+", default=None,
        help="backend labels to run, in this order (without CPU_ATTN: sparse ones alone, no dense)",
    )  # fmt: skip
    args = p.parse_args()
    chosen = backends(args.config, args.windows, args.tails, args.strides)
    if args.only:
        by_label = {b.label: b for b in chosen}
        chosen = [by_label[label] for label in args.only]  # in the order given
    config = EvalConfig(
        model="qwen2.5-coder-0.5b-instruct",
        tasks=tuple(args.tasks),
        contexts=tuple(args.contexts),
        samples=args.samples,
        depths=tuple(args.depths),
        backends=chosen,
        block_size=32,
        max_num_batched_tokens=2048,
        out_dir=args.out,
        progress=False,
        command="python " + " ".join(shlex.quote(a) for a in sys.argv),
    )
    config.sparse_only = not any(not b.is_sparse for b in chosen)
    run_eval(config)
