"""Decode speed on a CPU, dense against sparse: TPOT and inter-token latency through vLLM's OpenAI server.

    python benchmarks/decode_cpu.py [--contexts 8192 16384] [--new-tokens 64] \
        [--backends CPU_ATTN sparse_quoka sparse_quest sparse_twilight] [--name NAME]

One server per backend (the model's shipped config, prefix caching off), one streamed greedy request per context
(a passkey haystack, as the main job's), ``--new-tokens`` tokens forced (``ignore_eos``). Per request: TTFT, TPOT
(the time after the first token over the tokens after it), the median and p90 gap between streamed tokens, and the
share of KV pages the sparse backend's attention read (its counters, cumulative over the server's requests).
Writes benchmarks/results/decode_cpu_<name>.json with the machine, the command and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from passkey_cpu import cpu_run_record  # noqa: E402

from vllm_sparse.demo import served  # noqa: E402
from vllm_sparse.eval.models import resolve_model  # noqa: E402
from vllm_sparse.eval.passkey import make_passkey_sample  # noqa: E402
from vllm_sparse.stats import read_stats  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def timed_stream(client, model: str, messages: list[dict], new_tokens: int) -> dict:
    """One streamed greedy request of exactly ``new_tokens`` tokens; the arrival time of every streamed chunk."""
    start = time.perf_counter()
    stamps, parts, usage = [], [], None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=new_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "min_tokens": new_tokens},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter() - start)
            parts.append(chunk.choices[0].delta.content)
    tokens = usage.completion_tokens if usage is not None else len(stamps)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "completion_tokens": tokens,
        "prompt_tokens": usage.prompt_tokens if usage is not None else None,
        "ttft_s": stamps[0] if stamps else None,
        "total_s": time.perf_counter() - start,
        "tpot_ms": 1e3 * (stamps[-1] - stamps[0]) / (tokens - 1) if len(stamps) > 1 and tokens > 1 else None,
        "median_itl_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "p90_itl_ms": 1e3 * sorted(gaps)[int(0.9 * (len(gaps) - 1))] if gaps else None,
        "streamed_chunks": len(stamps),
        "text_head": "".join(parts)[:80],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--backends", nargs="+", default=["CPU_ATTN", "sparse_quoka", "sparse_quest", "sparse_twilight"])
    p.add_argument("--name", default="qwen0.5b")
    args = p.parse_args()
    from transformers import AutoTokenizer

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    samples = {c: make_passkey_sample(tokenizer, c, 0.5) for c in args.contexts}
    load_before = os.getloadavg()
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-sparse-decode-"))
    records = []
    for backend in args.backends:
        log_path, stats_path = log_dir / f"server-{backend}.log", log_dir / f"stats-{backend}.json"
        max_len = max(args.contexts) + args.new_tokens + 512
        print(f"[decode_cpu] {backend}: starting the server (log: {log_path})", flush=True)
        with served(path, args.model, backend, log_path, stats_path, max_len,
                    extra_args=("--no-enable-prefix-caching",)) as (client, cmd):  # fmt: skip
            for context, sample in samples.items():
                r = timed_stream(client, args.model, sample.messages, args.new_tokens)
                r.update(backend=backend, context=context, server_command=" ".join(cmd[1:]))
                if backend.lower().startswith("sparse_"):
                    r["page_counters_after"] = read_stats(str(stats_path))
                print(f"[decode_cpu] {backend} {context}: TTFT {r['ttft_s']:.1f} s, TPOT {r['tpot_ms']:.1f} ms, "
                      f"median ITL {r['median_itl_ms']:.1f} ms ({r['completion_tokens']} tokens)", flush=True)  # fmt: skip
                records.append(r)
    dense = {r["context"]: r for r in records if not r["backend"].lower().startswith("sparse_")}
    for r in records:
        d = dense.get(r["context"])
        if d and d is not r:
            r["tpot_vs_dense"] = round(r["tpot_ms"] / d["tpot_ms"], 3)
            r["ttft_vs_dense"] = round(r["ttft_s"] / d["ttft_s"], 3)

    note = "one streamed request at a time per server; ratios are to the dense backend of the same run"
    out = cpu_run_record(load_before, note, records)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path_out = RESULTS / f"decode_cpu_{args.name}.json"
    path_out.write_text(json.dumps(out, indent=2))
    print(f"wrote {path_out}")


if __name__ == "__main__":
    main()
