"""Independent re-check of a held-out finding: does a sparse backend lose the head of a 7-digit code hidden in a
long Python-source prompt?

    python benchmarks/needle_code_cpu.py [--contexts 8192 16384] [--depths 0.1 0.5 0.9] \
        [--configs dense quoka_shipped quoka_tail0 quest_shipped quest_tail0 twilight_shipped quoka_b0125]

Our own variant of the test (not the outside one): the haystack is a run of whole source files of this machine's
Python standard library (files the project's own ``code`` eval task and the kascade calibration do not use), cut at
a seeded offset per cell; the needle is a comment line of our own wording holding a random 7-digit code (first
digit nonzero, seeded, different per cell), put at the line boundary nearest the depth; the question comes at the
end of the one user message, wrapped in the model's chat template by vLLM's OpenAI server. Greedy decoding,
16 new tokens at most, chunked prefill of 2048 tokens, prefix caching off. One server per backend config, the
same prompts for every config. Writes benchmarks/results/needle_code_qwen0.5b_cpu/needle_code.json after every
answer (the machine, the command, versions, timings, every record).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from passkey_cpu import cpu_model  # (benchmarks/ is on the path of a script run from it)

RESULTS = Path(__file__).parent / "results" / "needle_code_qwen0.5b_cpu"
MODEL = "qwen2.5-coder-0.5b-instruct"

# whole files, in this order, then again from the start (none of them in the eval's CODE_HAYSTACK_FILES, nor
# the kascade calibration's argparse/textwrap/json.decoder)
HAYSTACK_FILES = (
    "logging/__init__.py", "shutil.py", "zipfile.py", "email/message.py", "http/client.py", "difflib.py",
    "pathlib.py", "calendar.py", "heapq.py", "urllib/parse.py", "csv.py", "threading.py", "collections/__init__.py",
)  # fmt: skip

NEEDLE = "# Ops reminder: the restore key for the nightly database backup is {code}; rotate it after every restore."
QUESTION = (
    "\n\nA comment somewhere in the source above, left by the ops team, gives the restore key for the nightly "
    "database backup. What is that restore key? Respond with the seven digits only."
)
INTRO = "Here is a dump of several Python modules.\n\n"

# name -> (attention backend, overrides on top of the shipped YAML; None = dense, no sparse config)
CONFIGS: dict[str, tuple[str, dict | None]] = {
    "dense": ("CPU_ATTN", None),
    "quoka_shipped": ("sparse_quoka", {}),
    "quoka_tail0": ("sparse_quoka", {"dense_tail_tokens": 0}),
    "quest_shipped": ("sparse_quest", {}),
    "quest_tail0": ("sparse_quest", {"dense_tail_tokens": 0}),
    "twilight_shipped": ("sparse_twilight", {}),
    "quoka_b0125": ("sparse_quoka", {"budget": {"fraction": 0.125}, "dense_below_tokens": 1024}),
}


def haystack_text() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in HAYSTACK_FILES:
        text = (lib / name).read_text(encoding="utf-8")
        if "<|" in text:  # nothing that looks like a chat-template special token
            continue
        parts.append(f"# ---- file: {name} ----\n{text.rstrip()}\n\n")
    return "".join(parts)


def build_prompt(tokenizer, hay_ids: list[int], context: int, depth: float, seed: int) -> dict:
    """A prompt of about ``context`` tokens (chat template included) with the needle at ``depth``."""
    rng = random.Random(seed)
    code = str(rng.randint(1_000_000, 9_999_999))
    needle = NEEDLE.format(code=code)

    def n_tokens(text: str) -> int:
        msgs = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))

    overhead = n_tokens(INTRO + "\n" + needle + "\n" + QUESTION)
    body = context - overhead - 16
    start = rng.randrange(0, len(hay_ids) - body)
    # start and end at line boundaries
    window = tokenizer.decode(hay_ids[start : start + body + 400])
    window = window[window.index("\n") + 1 :]
    ids = tokenizer.encode(window, add_special_tokens=False)[:body]
    head = tokenizer.decode(ids[: int(depth * len(ids))])
    tail = tokenizer.decode(ids[int(depth * len(ids)) :])
    cut = tail.find("\n") + 1  # finish the line the depth falls in
    head, tail = head + tail[:cut], tail[cut:]
    tail = tail[: tail.rfind("\n") + 1] if "\n" in tail else tail
    text = INTRO + head + needle + "\n" + tail.rstrip("\n") + QUESTION
    total = n_tokens(text)
    needle_at = n_tokens(INTRO + head) - 5  # roughly: tokens before the needle (minus the template's tail)
    return {
        "code": code,
        "messages": [{"role": "user", "content": text}],
        "prompt_tokens": total,
        "needle_token_position": needle_at,
        "needle_depth_actual": round(needle_at / total, 3),
        "haystack_offset_tokens": start,
    }


def score(code: str, answer: str) -> dict:
    m = re.search(r"\d+", answer)
    digits = m.group(0) if m else ""
    lead = 0
    while lead < min(len(code), len(digits)) and code[lead] == digits[lead]:
        lead += 1
    trail = 0
    while trail < min(len(code), len(digits)) and code[-1 - trail] == digits[-1 - trail]:
        trail += 1
    return {
        "answer_digits": digits,
        "exact": digits == code,
        "contains_code": code in answer,
        "leading_digits_match": lead,
        "trailing_digits_match": trail,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS))
    p.add_argument("--seed", type=int, default=20261127)
    p.add_argument("--out", default=str(RESULTS / "needle_code.json"))
    p.add_argument("--log-dir", default=None)
    args = p.parse_args()

    import torch
    import vllm
    from transformers import AutoTokenizer

    from vllm_sparse.config import shipped_config_path
    from vllm_sparse.demo import served, stream_chat
    from vllm_sparse.eval.models import resolve_model
    from vllm_sparse.stats import read_stats

    path = resolve_model(MODEL)
    shipped = shipped_config_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hay_ids = tokenizer.encode(haystack_text(), add_special_tokens=False)
    cells = []
    for ci, context in enumerate(args.contexts):
        for di, depth in enumerate(args.depths):
            prompt = build_prompt(tokenizer, hay_ids, context, depth, args.seed + 1000 * ci + di)
            cells.append({"context": context, "depth": depth, **prompt})
            print(
                f"cell {context}/{depth}: code {prompt['code']}, {prompt['prompt_tokens']} tokens, "
                f"needle at {prompt['needle_depth_actual']}",
                flush=True,
            )
    max_len = max(c["prompt_tokens"] for c in cells) + 64
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="needle-code-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "model": MODEL,
        "model_path": path,
        "shipped_config": str(shipped),
        "haystack": {
            "source": f"Python {platform.python_version()} standard library source files, whole, in this order",
            "files": list(HAYSTACK_FILES),
            "tokens": len(hay_ids),
        },
        "needle": NEEDLE,
        "question": QUESTION,
        "intro": INTRO,
        "serving": {
            "server": "vllm.entrypoints.openai.api_server, chat completions, one server per config",
            "max_num_batched_tokens": 2048,
            "chunked_prefill": True,
            "prefix_caching": False,
            "block_size": 32,
            "max_tokens": 16,
            "temperature": 0.0,
            "max_model_len": max_len,
        },
        "configs": {
            name: {
                "backend": CONFIGS[name][0],
                "additional_config": None
                if CONFIGS[name][1] is None
                else {"sparse_attention": {"config": str(shipped), **CONFIGS[name][1]}},
            }
            for name in args.configs
        },
        "cells": [{k: v for k, v in c.items() if k != "messages"} for c in cells],
        "load_average_before": os.getloadavg(),
        "timings": {},
        "records": [],
    }

    def save() -> None:  # recreate the folder each time, and keep a copy outside the repo
        text = json.dumps(out, indent=2)
        Path(tempfile.gettempdir(), "needle_code_backup.json").write_text(text)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text)

    save()
    t_all = time.perf_counter()
    for name in args.configs:
        backend, overrides = CONFIGS[name]
        extra = out["configs"][name]["additional_config"]
        log_path, stats_path = log_dir / f"server-{name}.log", log_dir / f"stats-{name}.json"
        t0 = time.perf_counter()
        print(f"[{time.strftime('%H:%M:%S')}] starting {name} ({backend}) log {log_path}", flush=True)
        with served(path, MODEL, backend, log_path, stats_path, max_len, additional_config=extra,
                    extra_args=("--enable-chunked-prefill", "--no-enable-prefix-caching")) as (client, cmd):  # fmt: skip
            timing = {"startup_s": time.perf_counter() - t0, "server_command": cmd}
            for cell in cells:
                answer, ttft, total = stream_chat(client, MODEL, cell["messages"])
                rec = {
                    "config": name,
                    "backend": backend,
                    "context": cell["context"],
                    "depth": cell["depth"],
                    "prompt_tokens": cell["prompt_tokens"],
                    "code": cell["code"],
                    "answer": answer,
                    **score(cell["code"], answer),
                    "ttft_s": ttft,
                    "total_s": total,
                }
                out["records"].append(rec)
                save()
                mark = "OK " if rec["exact"] else "BAD"
                print(
                    f"[{time.strftime('%H:%M:%S')}] {mark} {name:18s} {cell['context']:6d} d={cell['depth']:.1f} "
                    f"code {cell['code']} answer {answer!r} lead {rec['leading_digits_match']} "
                    f"trail {rec['trailing_digits_match']} ttft {ttft or 0:.1f}s",
                    flush=True,
                )
        timing["total_s"] = time.perf_counter() - t0
        if backend.startswith("sparse_"):
            try:
                timing["page_counters"] = read_stats(str(stats_path))
            except Exception as e:  # noqa: BLE001 (the counters are a side note)
                timing["page_counters"] = f"unreadable: {e}"
        lines = log_path.read_text(errors="replace").splitlines()
        timing["server_log_sparse_lines"] = [ln for ln in lines if "sparse" in ln.lower()][:12]
        out["timings"][name] = timing
        save()
    out["total_s"] = time.perf_counter() - t_all
    out["load_average_after"] = os.getloadavg()
    save()
    print(f"wrote {out_path}", flush=True)


if __name__ == "__main__":
    main()
