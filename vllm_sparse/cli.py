"""``vllm-sparse``: show-config, passkey (the main job), calibrate (Kascade anchors), eval, recall."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_sparse.config import SparseConfigError, method_of_backend, resolve_config, shipped_configs
from vllm_sparse.eval.cli import add_eval_parser
from vllm_sparse.eval.recall_cli import add_recall_parser


def _num_layers(model: str) -> int | None:
    cfg = Path(model) / "config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text())
        return data.get("num_hidden_layers") or data.get("text_config", {}).get("num_hidden_layers")
    return None


def show_config(args) -> int:
    if args.list:
        for path, names in shipped_configs().items():
            print(f"{path.name}: {', '.join(names)}")
        return 0
    try:
        method = method_of_backend(args.backend)
        additional = json.loads(args.additional_config) if args.additional_config else None
        resolved = resolve_config(method, args.model, additional)
    except (SparseConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    layers = _num_layers(args.model) if args.model else None
    reasons = resolved.config.model_reasons(layers) if layers else []
    print(f"# source: {resolved.source}")
    import yaml

    print(yaml.safe_dump(resolved.config.model_dump(), sort_keys=False), end="")
    for r in reasons:
        print(f"error: {r}", file=sys.stderr)
    return 2 if reasons else 0


def passkey(args) -> int:
    from vllm_sparse.demo import print_result, run_passkey

    extra = json.loads(args.additional_config) if args.additional_config else None
    r = run_passkey(args.model, args.backend, args.context, args.depth, args.block_size, additional_config=extra)
    print_result(r)
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=2))
    return 0 if r["correct"] else 1  # the main job fails when the model answers wrong


def calibrate(args) -> int:
    from vllm_sparse.calibration.run import calibrate as run
    from vllm_sparse.calibration.run import default_texts, kascade_yaml_block, plot, write_config
    from vllm_sparse.eval.models import resolve_model

    texts = [(str(p), Path(p).read_text(encoding="utf-8")) for p in args.data] if args.data else default_texts()
    path = resolve_model(args.model)
    record = run(path, texts, args.prompts, args.tokens, args.anchors, args.k)
    out = Path(args.out)
    write_config(out, kascade_yaml_block(record, args.model), models=[args.model])
    png = Path(args.png) if args.png else out.with_suffix(".png")
    plot(record, png, args.model)
    print(f"anchors {record['anchors']} (objective {record['objective']:.3f}); wrote {out} and {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-sparse")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show-config", help="print the resolved selector config for a model and backend")
    s.add_argument("--model", default=None, help="model name or local folder (matches shipped configs)")
    s.add_argument("--backend", default="sparse_quoka")
    s.add_argument("--additional-config", default=None, help="the JSON you would pass to vLLM")
    s.add_argument("--list", action="store_true", help="list the shipped configs and the model names each matches")
    s.set_defaults(fn=show_config)
    k = sub.add_parser("passkey", help="serve a model with a backend and ask for a hidden passkey")
    k.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    k.add_argument("--backend", default="sparse_quoka")
    k.add_argument("--context", type=int, default=8192)
    k.add_argument("--depth", type=float, default=0.5)
    k.add_argument("--block-size", type=int, default=32)
    k.add_argument("--additional-config", default=None)
    k.add_argument("--out", default=None, help="write the result record as JSON")
    k.set_defaults(fn=passkey)
    c = sub.add_parser("calibrate", help="Kascade: anchor layers and head maps of a model from a dense run")
    c.add_argument("--model", required=True, help="local HuggingFace folder or a known model name")
    c.add_argument("--data", nargs="*", default=None, help="text files (default: Python standard-library sources)")
    c.add_argument("--prompts", type=int, default=4, help="calibration prompts")
    c.add_argument("--tokens", type=int, default=1536, help="tokens per prompt")
    c.add_argument("--anchors", type=int, default=5, help="anchor layers, layer 0 included")
    c.add_argument("--k", type=int, default=64, help="top-k tokens of the recovery score (paper: 64)")
    c.add_argument("--out", required=True, help="YAML config to write (its kascade block is replaced if it exists)")
    c.add_argument("--png", default=None, help="similarity-matrix plot (default: the YAML path with .png)")
    c.set_defaults(fn=calibrate)
    add_eval_parser(sub)
    add_recall_parser(sub)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
