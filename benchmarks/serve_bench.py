"""Serving benchmark the way vLLM users measure: ``vllm serve`` in its default mode (torch.compile,
CUDA graphs) and ``vllm bench serve``, every backend in one session on one GPU.

Model: Llama-3.1-8B shapes with random weights (``--load-format dummy``) and a synthetic
tokenizer over its 128,256 ids (``build_model``: four letters per token, so prompts have exactly
the asked lengths; no model hub needed). Prefix caching off,
chunks of 8192 tokens (``--chunk``), at most 16 running requests, each backend's shipped defaults plus the
``--sparse-config`` given (default: a 12.5% budget).

Loads (``--loads``, names from ``LOADS``): ``tpot128k`` one 130,000-token prompt, 256 new tokens;
``decode16`` 16 concurrent 16,000-token prompts, 256 new tokens (arriving together: prefill, then
16 decodes); ``A`` 32 requests of 16,000/256 at concurrency 16; ``B`` 8 of 64,000/128 at
concurrency 4; ``C`` 6 of 16,000/16 one at a time. Every server log is scanned for vLLM's
"JIT compilation during inference" warnings (kernels compiled while serving). ``prof16k`` and
``prof128k`` (one per server, left out of the plot) serve one request of 16,000 or 130,000 tokens
(``prof16x16k``: 16 requests of 16,000 together; ``prof_real32k_x16``: ``real32k_x16``'s) with vLLM's torch
profiler on for 24 of its decode steps, traces in ``DIR/profile_<label>/``; then
``benchmarks/decode_trace.py DIR/profile_flash_attn DIR/profile_sparse_quoka`` says where each step's
time goes. Per-request ITLs and TTFTs are kept in every result JSON (``--save-detailed``).

    python benchmarks/serve_bench.py run --out DIR [--backends FLASH_ATTN,FLASHINFER,sparse_quest,...]
    python benchmarks/serve_bench.py plot DIR/serve_bench.json     # PNG beside the JSON

Writes ``DIR/serve_bench.json`` (merged with an existing one: backends of earlier calls are kept),
every ``vllm bench serve`` result JSON and every server log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from e2e_gpu import LLAMA_8B, gpu_name, versions  # noqa: E402

VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
LOADS = {
    "tpot128k": {"input": 130000, "output": 256, "prompts": 1, "concurrency": 1},
    "decode16": {"input": 16000, "output": 256, "prompts": 16, "concurrency": 16},
    "A": {"input": 16000, "output": 256, "prompts": 32, "concurrency": 16},
    "B": {"input": 64000, "output": 128, "prompts": 8, "concurrency": 4},
    "C": {"input": 16000, "output": 16, "prompts": 6, "concurrency": 1},
    # one request under vLLM's torch profiler (decode steps 9-32 of it; benchmarks/decode_trace.py reads the trace)
    "prof16k": {"input": 16000, "output": 48, "prompts": 1, "concurrency": 1, "profile": True},
    "prof128k": {"input": 130000, "output": 48, "prompts": 1, "concurrency": 1, "profile": True},
    # 16 requests together: their prefill chunks (the first-prefilled decode beside the later chunks), 8 steps
    # decoding all 16, then the profiled steps; 128 tokens each, so that no request ends before them
    "prof16x16k": {"input": 16000, "output": 128, "prompts": 16, "concurrency": 16, "profile": True},
    # a real model's (``--real-model``) prompts of the accuracy eval (``vllm_sparse.eval.tasks``: retrieval, variable
    # tracking, code), one at a time: TTFT where attention is what a real model computes, not random weights'
    "real16k": {"input": 16384, "output": 16, "prompts": 9, "concurrency": 1, "eval": True},
    "real32k": {"input": 32768, "output": 16, "prompts": 9, "concurrency": 1, "eval": True},
    # decode on real weights: 16 such prompts together, 128 new tokens each, 256 short of 32K to leave room for them
    # (what a selector keeps at decode follows the model's attention; random weights keep nearly every candidate of
    # Twilight's top-p)
    "real32k_x16": {"input": 32512, "output": 128, "prompts": 16, "concurrency": 16, "eval": True},
    # the same under the profiler: 24 steps decoding all 16 (dense decode on the real 1.5B ran 0.84-0.92x FLASH_ATTN
    # while its attention kernel alone matched FlashAttention; real32k_x16's median ITL mixes batch sizes 1-16)
    "prof_real32k_x16": {
        "input": 32512,
        "output": 128,
        "prompts": 16,
        "concurrency": 16,
        "eval": True,
        "profile": True,
    },
    # past a model's trained window with ``--real-model NAME@yarn4`` (``vllm_sparse.eval.rope_variant``): a real
    # model's attention at 64K and 128K, where random weights keep every block of compact and every page is as heavy
    "real64k": {"input": 65536, "output": 16, "prompts": 9, "concurrency": 1, "eval": True},
    "real128k": {"input": 131072, "output": 16, "prompts": 6, "concurrency": 1, "eval": True},
}
EVAL_TASKS = ("niah_multikey", "vt", "code")  # the tasks of the ``eval`` loads, in turn (3 prompts each)
PROFILED_STEPS = 24  # decode steps a profile load records, after its prefill chunks and 8 decode steps


def profile_skip_steps(load: str, chunk: int) -> int:
    """Engine steps before a profile load's recorded ones: its prompts' prefill chunks (the prompts arrive
    together), then 8 decode steps."""
    spec = LOADS[load]
    return -(-spec["prompts"] * spec["input"] // chunk) + 8


METRICS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
)
DEFAULT_SPARSE = {"budget": {"fraction": 0.125}}


ALPHABET = "abcdefghijklmnopqrst"  # 20 letters: 20**4 = 160,000 four-letter tokens >= the 128,256 ids


SPECIAL = {128000: "BOS_", 128001: "EOS_"}  # outside the alphabet: never found inside other tokens' text


def token_text(i: int) -> str:
    """Token ``i`` of the synthetic tokenizer: four letters (base 20); the special ones upper case."""
    return SPECIAL.get(i) or "".join(ALPHABET[(i // 20**k) % 20] for k in (3, 2, 1, 0))


def build_model(path: Path) -> Path:
    """Llama-3.1-8B config (random weights at load) and a synthetic tokenizer over its ids.

    Every token is four letters and text is their concatenation (split back every four
    characters), so decoding and re-encoding give the same ids, prompts have exactly the asked
    lengths, and a prompt of n tokens has 4n characters: vLLM bounds a prompt's text by
    ``max_model_len`` times the longest token's characters (a word-level tokenizer joined by
    spaces exceeds that bound near ``max_model_len``).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_8B, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}))
    if not (path / "tokenizer.json").exists():
        vocab = {token_text(i): i for i in range(LLAMA_8B["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=token_text(0)))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(".{4}"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": token_text(128000),
                    "eos_token": token_text(128001),
                    "model_max_length": 131072,
                }
            )
        )
    return path


class Served:
    """The model every server of a run serves: the synthetic Llama-3.1-8B (``build_model``, random weights) or a
    real one (``--real-model``: a known model of ``vllm_sparse.eval.models``, its weights staged or downloaded)."""

    def __init__(self, path: Path, name: str = "llama8b", real: bool = False, max_model_len: int = 131072):
        self.path, self.name, self.real, self.max_model_len = Path(path), name, real, max_model_len

    @classmethod
    def real_model(cls, name: str) -> Served:
        from vllm_sparse.eval.models import model_max_context, resolve_model

        path = resolve_model(name, progress=False)
        return cls(Path(path), name, True, model_max_context(path))


def served(model) -> Served:
    return model if isinstance(model, Served) else Served(Path(model))


def need_real(model: Served, load: str) -> None:
    """Refuse an ``eval`` load on the synthetic model (its prompts need a real model's tokenizer and weights)."""
    if LOADS[load].get("eval") and not model.real:
        raise SystemExit(f"load {load!r} needs a real model (--real-model)")


def server_cmd(
    model, backend: str, port: int, sparse_cfg: dict | None, chunk: int = 8192, profile: tuple[Path, int] | None = None,
    extra_args: list[str] | None = None,
) -> list[str]:
    """``model``: a ``Served`` (or the synthetic model's folder). ``profile``: (trace folder, engine steps to skip
    first): start vLLM's torch profiler, which a load with ``"profile"`` turns on (``vllm bench serve --profile``)
    for ``PROFILED_STEPS`` steps. ``extra_args``: more ``vllm serve`` arguments (a variant's ``server_args``),
    last so that they win."""
    m = served(model)
    cmd = VLLM + [
        "serve", str(m.path), "--port", str(port), "--attention-backend", backend,
        "--load-format", "auto" if m.real else "dummy", "--dtype", "bfloat16", "--max-model-len", str(m.max_model_len),
        "--max-num-batched-tokens", str(chunk), "--max-num-seqs", "16", "--no-enable-prefix-caching",
        "--gpu-memory-utilization", "0.9", "--served-model-name", m.name,
    ]  # fmt: skip
    if sparse_cfg is not None:
        cmd += ["--additional-config", json.dumps({"sparse_attention": sparse_cfg})]
    if profile is not None:
        trace_dir, skip = profile
        cfg = {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "delay_iterations": skip,
               "max_iterations": PROFILED_STEPS, "ignore_frontend": True, "torch_profiler_with_stack": False}  # fmt: skip
        cmd += ["--profiler-config", json.dumps(cfg)]
    return cmd + list(extra_args or [])


def server_settings(label: str, sparse_cfg: dict, variants_declared: dict[str, dict] | None = None):
    """``(backend, sparse config or None, extra vllm serve arguments)`` of a label ``BACKEND[+variant...]``.
    A variant is ``sparse_decode`` or one of ``variants_declared`` (``--variant NAME JSON``): its
    ``server_args`` (a list) are added to the server's command line, any backend; its ``env`` (a dict) to
    the server's environment (``server_env``); its other fields are merged into the sparse config, so a
    dense backend's variants may hold ``server_args`` and ``env`` only."""
    backend, *variants = label.split("+")
    sparse = backend.lower().startswith("sparse_")
    cfg = json.loads(json.dumps(sparse_cfg)) if sparse else None
    extra: list[str] = []
    for v in variants:
        fields = {"sparse_decode": True} if v == "sparse_decode" else (variants_declared or {}).get(v)
        if fields is None:
            raise SystemExit(f"unknown variant {v!r} (declare it with --variant {v} JSON)")
        fields = json.loads(json.dumps(fields))
        extra += [str(a) for a in fields.pop("server_args", [])]
        fields.pop("env", None)
        if fields and not sparse:
            raise SystemExit(f"{label}: variant {v!r} sets sparse fields {sorted(fields)} on a dense backend")
        if fields:
            cfg.update(fields)
    return backend, cfg, extra


def server_env(label: str, variants_declared: dict[str, dict] | None = None) -> dict[str, str]:
    """The environment variables that the variants of ``label`` set on its server (their ``env``)."""
    env: dict[str, str] = {}
    for v in label.split("+")[1:]:
        env.update({k: str(x) for k, x in ((variants_declared or {}).get(v) or {}).get("env", {}).items()})
    return env


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except Exception:  # noqa: BLE001
            pass
        time.sleep(2)
    raise TimeoutError(f"server not ready after {timeout} s")


def eval_prompts(model: Served, load: str, out: Path) -> Path:
    """``out/prompts_<load>.jsonl``: the ``eval`` load's prompts for a real model, made once: ``EVAL_TASKS`` in
    turn at the load's context capped by the model's (seed 0, needles at depths 0.1, 0.5 and 0.9), each a chat
    prompt with its answer begun."""
    need_real(model, load)
    path = out / f"prompts_{load}.jsonl"
    if not path.exists():
        from transformers import AutoTokenizer

        from vllm_sparse.eval.tasks import make_samples

        spec = LOADS[load]
        tok = AutoTokenizer.from_pretrained(str(model.path))
        per_task = -(-spec["prompts"] // len(EVAL_TASKS))
        ctx = min(spec["input"], model.max_model_len)
        samples = [s for t in EVAL_TASKS for s in make_samples(tok, t, ctx, per_task, (0.1, 0.5, 0.9), 0)]
        path.write_text("".join(json.dumps({"prompt": s.prompt, "task": s.task, "prompt_tokens": s.prompt_tokens}) + "\n"
                                for s in samples[: spec["prompts"]]))  # fmt: skip
    return path


def bench_args(model, port: int, load: str, out: Path, name: str) -> list[str]:
    """The ``vllm bench serve`` arguments of one load (its result goes to ``out / name``): random prompts of the
    load's length, or (``eval`` loads, a real model only) the eval's prompts through the custom dataset."""
    spec, m = LOADS[load], served(model)
    need_real(m, load)
    if spec.get("eval"):
        data = ["--dataset-name", "custom", "--dataset-path", str(out / f"prompts_{load}.jsonl"),
                "--custom-output-len", str(spec["output"]), "--skip-chat-template", "--disable-shuffle"]  # fmt: skip
    else:
        data = ["--dataset-name", "random", "--random-input-len", str(spec["input"]),
                "--random-output-len", str(spec["output"])]  # fmt: skip
    return [
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", m.name,
        "--tokenizer", str(m.path), *data, "--num-prompts", str(spec["prompts"]),
        "--max-concurrency", str(spec["concurrency"]), "--request-rate", "inf", "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--seed", "0",
        "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", name,
    ] + (["--profile"] if spec.get("profile") else [])  # fmt: skip


def bench_loads(model, port: int, jobs: list[tuple[str, str]], out: Path, tag: str, deadline: float) -> list:
    """Run ``(load, result name)`` jobs in order through ``vllm bench serve``'s own entry point
    (``vllm.benchmarks.serve.main``, what the CLI calls), all in one client process: the CLI's
    start-up (imports, tokenizer) costs about 25 s per call. Loads past ``deadline`` are skipped.
    Returns one result dict per job, with the equivalent CLI command."""
    spec_path = out / f"client_{tag}.json"
    spec_path.write_text(json.dumps({"jobs": [bench_args(model, port, ld, out, nm) for ld, nm in jobs],
                                     "deadline_epoch": time.time() + deadline - time.monotonic()}))  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(HERE), "client", str(spec_path)], capture_output=True, text=True,
                          timeout=3600, check=False)  # fmt: skip
    (out / f"bench_{tag}.log").write_text(proc.stdout[-60000:] + proc.stderr[-20000:])
    done = json.loads(spec_path.read_text()).get("done", {})
    results = []
    for load, name in jobs:
        args = bench_args(model, port, load, out, name)
        res = {"load": load, **LOADS[load], "command": shlex.join(VLLM + ["bench", "serve"] + args)}
        res.update(done.get(name, {}))
        path = out / name
        if res.get("skipped"):
            res["error"] = "skipped: past the deadline"
        elif not path.exists():
            res["error"] = res.get("error") or f"rc={proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"
        else:
            res.update({k: json.loads(path.read_text()).get(k) for k in METRICS})
        results.append(res)
    res_wall = round(time.monotonic() - t0, 1)
    for r in results:
        r["client_wall_s"] = res_wall
    return results


def client(spec_path: Path) -> None:
    """The client process of ``bench_loads``: parse each job's arguments with the CLI's parser and
    run ``vllm.benchmarks.serve.main`` on them, recording each job's wall time or error."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    doc = json.loads(spec_path.read_text())
    doc["done"] = {}
    for argv in doc["jobs"]:
        name = argv[argv.index("--result-filename") + 1]
        if time.time() > doc["deadline_epoch"]:
            doc["done"][name] = {"skipped": True}
            continue
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        t0 = time.monotonic()
        try:
            main(parser.parse_args(argv))
            doc["done"][name] = {"wall_s": round(time.monotonic() - t0, 1)}
        except Exception as e:  # noqa: BLE001  (recorded; the next load still runs)
            doc["done"][name] = {"error": f"{type(e).__name__}: {e}"}
        spec_path.write_text(json.dumps(doc))


def mean_of_passes(passes: list[dict]) -> dict:
    """One load's result over repeated passes on the same server: the mean of each metric, and
    every pass as measured."""
    if len(passes) == 1:
        return passes[0]
    ok = [p for p in passes if "error" not in p]
    if not ok:
        return {**passes[0], "passes": passes}
    merged = dict(ok[0])
    for k in METRICS:
        vals = [p.get(k) for p in ok]
        if all(isinstance(v, (int, float)) for v in vals):
            merged[k] = sum(vals) / len(vals)
    merged["passes"] = passes
    return merged


def run_backend(
    label: str, model, out: Path, loads: list[str], sparse_cfg: dict, port: int, deadline: float, repeat: int = 1,
    chunk: int = 8192, variants_declared: dict[str, dict] | None = None,
) -> dict:  # fmt: skip
    """One server for ``label`` (``BACKEND[+variant...]``, see ``server_settings``), every load ``repeat``
    times on it."""
    backend, cfg, extra = server_settings(label, sparse_cfg, variants_declared)
    tag = label.lower().replace("+", "_")
    log_path = out / f"server_{tag}.log"
    profiled = [ld for ld in loads if LOADS[ld].get("profile")]
    if len(profiled) > 1 or (profiled and repeat > 1):
        raise SystemExit(f"{label}: one pass of one profile load per server ({profiled})")
    profile = (out / f"profile_{tag}", profile_skip_steps(profiled[0], chunk)) if profiled else None
    cmd = server_cmd(model, backend, port, cfg, chunk, profile, extra)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", VLLM_SPARSE_JIT_TRACE="1",
                                         **server_env(label, variants_declared)))  # fmt: skip
    res = {"backend": backend, "label": label, "sparse_config": cfg, "server_command": shlex.join(cmd), "chunk": chunk,
           "server_env": server_env(label, variants_declared), "loads": {}}  # fmt: skip
    try:
        res["engine_start_s"] = round(wait_ready(port, proc, 900), 1)
        names = {ld: [f"{tag if i == 0 else f'{tag}_pass{i + 1}'}_{ld}.json" for i in range(repeat)] for ld in loads}
        jobs = [(ld, nm) for i in range(repeat) for ld in loads for nm in names[ld][i : i + 1]]
        results = dict(zip((nm for _, nm in jobs), bench_loads(model, port, jobs, out, tag, deadline)))
        for load in loads:
            passes = [results[nm] for nm in names[load]]
            if all(p.get("error", "").startswith("skipped") for p in passes):
                res.setdefault("skipped_loads", []).append(load)
                continue
            res["loads"][load] = mean_of_passes(passes)
            print(f"[{label}] {load}: {json.dumps({k: res['loads'][load].get(k) for k in METRICS[:9]})}", flush=True)
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=30)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        time.sleep(3)
    text = log_path.read_text(errors="replace")
    res["jit_during_inference"] = sorted(set(re.findall(r"JIT compilation during inference: (\w+)", text)))
    res["cudagraph_notes"] = sorted(set(re.findall(r"[^\n]*cudagraph_mode[^\n]*", text)))[:5]
    return res


def collect(out: Path) -> dict:
    """Rebuild ``serve_bench.json`` from a results folder's raw files (every ``vllm bench serve``
    result JSON and server log), keeping what an earlier ``serve_bench.json`` there says of each
    run; for runs whose entry was lost (a run stopped before writing it)."""
    path = out / "serve_bench.json"
    doc = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    for log in sorted(out.glob("server_*.log")):
        tag = log.stem[len("server_") :]
        label = tag if tag.startswith("sparse_") else tag.upper()
        run = doc["runs"].setdefault(label, {"backend": label.split("+")[0], "label": label, "loads": {}})
        for load, spec in LOADS.items():
            raw = out / f"{tag}_{load}.json"
            if load in run["loads"] or not raw.exists():
                continue
            data = json.loads(raw.read_text())
            run["loads"][load] = {"load": load, **spec, **{k: data.get(k) for k in METRICS}}
            if not data.get("completed"):
                run["loads"][load]["error"] = "every request failed (see the bench log)"
        text = log.read_text(errors="replace")
        run["jit_during_inference"] = sorted(set(re.findall(r"JIT compilation during inference: (\w+)", text)))
    doc["summary"] = summarise(doc["runs"])
    path.write_text(json.dumps(doc, indent=1))
    return doc


def decode_throughput(m: dict) -> float | None:
    """Tokens per second while the load's requests decode together: its concurrency over the
    median inter-token latency (a decode step of the full batch; the mean TPOT also counts the
    steps that prefill other requests' chunks, and output throughput counts every prefill)."""
    itl, conc = m.get("median_itl_ms"), min(m.get("concurrency") or 0, m.get("prompts") or 0)
    return round(conc * 1000 / itl, 1) if itl and conc else None


def ttft_limit_ms(flash_attn_ttft_ms: float, input_len: int, budget: float, chunk: int = 8192, layers: int = 32) -> dict:
    """Issue 11's TTFT limit of a sparse method for one prompt: FLASH_ATTN's TTFT without its
    attention to past chunks, plus the budget's share of that attention (each chunk's attention to
    its own tokens stays). FLASH_ATTN's attention per layer is ``a * q * (ctx + q / 2)`` with ``a``
    fitted on CUDA-event timings of its kernel (``vllm_sparse.cost``, ``step_breakdown_gpu.py``)."""
    from vllm_sparse.cost import COEFFICIENTS

    a = COEFFICIENTS[("hopper", "quest")][0]  # us per million query-key pairs (FA3, H100)
    past = own = 0.0
    for start in range(0, input_len, chunk):
        q = min(chunk, input_len - start)
        past += a * q * start / 1e6 * layers / 1e3  # ms
        own += a * q * q / 2 / 1e6 * layers / 1e3
    return {
        "flash_attn_attention_ms": round(past + own, 1),
        "flash_attn_past_attention_ms": round(past, 1),
        "limit_ms": round(flash_attn_ttft_ms - past * (1 - budget), 1),
    }


def summarise(results: dict) -> dict:
    """Per load, every backend's key metrics against FLASH_ATTN's (ratios > 1: better for throughput)."""
    table = {}
    base = results.get("FLASH_ATTN", {}).get("loads", {})
    for label, r in results.items():
        for load, m in r.get("loads", {}).items():
            if "error" in m or not m.get("completed"):
                continue
            row = table.setdefault(load, {})
            b = base.get(load, {})
            b = b if b.get("completed") else {}
            entry = {k: m.get(k) for k in ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                           "mean_tpot_ms", "median_itl_ms")}  # fmt: skip
            entry["decode_throughput"] = decode_throughput(m)
            if b and "error" not in b and b.get("output_throughput") and b.get("mean_ttft_ms") and b.get("mean_tpot_ms"):
                entry["throughput_vs_flash_attn"] = round(m["output_throughput"] / b["output_throughput"], 3)
                entry["ttft_vs_flash_attn"] = round(m["mean_ttft_ms"] / b["mean_ttft_ms"], 3)
                entry["tpot_vs_flash_attn"] = round(m["mean_tpot_ms"] / b["mean_tpot_ms"], 3)
                if entry["decode_throughput"] and decode_throughput(b):
                    entry["decode_throughput_vs_flash_attn"] = round(entry["decode_throughput"] / decode_throughput(b), 3)
            if load == "tpot128k" and label.startswith("sparse_") and base.get(load, {}).get("mean_ttft_ms"):
                limit = ttft_limit_ms(base[load]["mean_ttft_ms"], m["input"], budget_fraction(r), r.get("chunk", 8192))
                entry["ttft_limit"] = {**limit, "ttft_vs_limit": round(m["mean_ttft_ms"] / limit["limit_ms"], 3)}
            row[label] = entry
    return table


def budget_fraction(run: dict) -> float:
    return float(((run.get("sparse_config") or {}).get("budget") or {}).get("fraction", 0.125))


def plot(path: Path, *more: Path, png: Path | None = None) -> Path:
    """Each backend against FLASH_ATTN, per load and metric (a PNG beside the first JSON, or
    ``png``). Several JSONs (runs on different machines): each one's backends against its own
    FLASH_ATTN, in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    table = {ld: dict(row) for ld, row in data["summary"].items()}
    for other in more:
        for ld, row in json.loads(other.read_text())["summary"].items():
            table.setdefault(ld, {}).update({lb: v for lb, v in row.items() if lb != "FLASH_ATTN"})
    loads = [ld for ld in LOADS if ld in table and not LOADS[ld].get("profile")]  # profiled loads run slower
    metrics = [("throughput_vs_flash_attn", "output throughput / FLASH_ATTN (higher is better)"),
               ("decode_throughput_vs_flash_attn", "decode throughput / FLASH_ATTN (higher is better)"),
               ("ttft_vs_flash_attn", "mean TTFT / FLASH_ATTN (lower is better)"),
               ("tpot_vs_flash_attn", "mean TPOT / FLASH_ATTN (lower is better)")]  # fmt: skip
    labels = sorted({lb for ld in loads for lb in table[ld]}, key=lambda s: (s != "FLASH_ATTN", s))
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    width = 0.8 / max(len(labels), 1)
    for ax, (key, title) in zip(axes, metrics):
        for i, lb in enumerate(labels):
            vals = [table[ld].get(lb, {}).get(key, float("nan")) for ld in loads]
            ax.bar([x + i * width for x in range(len(loads))], vals, width, label=lb)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(loads))], loads)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    gpu = (data.get("gpu") or "").split("\n")[0]  # nvidia-smi lists every GPU of the host
    model = data.get("model") or "llama8b (random)"
    what = "Llama-3.1-8B shapes (random weights)" if model.startswith("llama8b") else f"{model} (real weights)"
    fig.suptitle(f"vllm serve + vllm bench serve, {gpu}, {what}", fontsize=10)
    fig.tight_layout()
    png = png or path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    return png


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--workdir", default="/tmp/serve_bench")
    r.add_argument("--backends", default="FLASH_ATTN,FLASHINFER,sparse_quest,sparse_twilight,sparse_quoka",
                   help="comma-separated LABEL[@load/load]: BACKEND[+sparse_decode], optionally its own loads")  # fmt: skip
    r.add_argument("--loads", default="tpot128k,decode16,A,B,C")
    r.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "JSON"),
                   help="a label suffix +NAME whose JSON fields are merged into that server's sparse config "
                   "(its server_args, a list, go to vllm serve's command line and its env, a dict, to the server's "
                   "environment, for any backend)")
    r.add_argument("--sparse-config", default=json.dumps(DEFAULT_SPARSE))
    r.add_argument("--port", type=int, default=8123)
    r.add_argument("--chunk", type=int, default=8192, help="--max-num-batched-tokens of every server (chunked prefill)")
    r.add_argument("--repeat-baseline", type=int, default=2, help="passes of every load on FLASH_ATTN (mean)")
    r.add_argument("--repeat", type=int, default=1, help="passes of every load on the other backends (mean)")
    r.add_argument("--deadline", type=float, default=1e9, help="seconds; later loads are skipped (and listed)")
    r.add_argument("--real-model", help="serve this known model (vllm_sparse.eval.models) with its real weights "
                   "instead of the random Llama-3.1-8B; its eval loads (real16k, real32k, real32k_x16, real64k, real128k) serve the accuracy eval's prompts")  # fmt: skip
    p = sub.add_parser("plot")
    p.add_argument("json", nargs="+", help="one serve_bench.json, or several (each against its own FLASH_ATTN)")
    p.add_argument("--png", help="output (default: beside the first JSON)")
    c = sub.add_parser("collect")
    c.add_argument("dir")
    cl = sub.add_parser("client", help="(internal) run bench_loads' jobs")
    cl.add_argument("spec")
    args = ap.parse_args()
    if args.cmd == "client":
        client(Path(args.spec))
        return
    if args.cmd == "plot":
        print(plot(*map(Path, args.json), png=Path(args.png) if args.png else None))
        return
    if args.cmd == "collect":
        print(json.dumps(collect(Path(args.dir))["summary"], indent=1))
        return
    from gpu_preflight import plugin_problems

    if any(b.split("+")[0].startswith("sparse_") for b in args.backends.split(",")) and (bad := plugin_problems()):
        raise SystemExit("serve_bench: vllm-sparse would not load: " + "; ".join(bad))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.real_model:
        model = Served.real_model(args.real_model)
    else:
        model = Served(build_model(Path(args.workdir) / "llama8b_dummy"))
    path = out / "serve_bench.json"
    doc = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    loads = args.loads.split(",")
    plan = [(label, own.split("/") if own else loads)  # LABEL@load/load: this label's loads only
            for label, _, own in (spec.partition("@") for spec in args.backends.split(","))]  # fmt: skip
    for ld in sorted({ld for _, lds in plan for ld in lds if LOADS[ld].get("eval")}):
        eval_prompts(model, ld, out)  # before any server starts (and refused on the synthetic model)
    t_start = time.monotonic()
    doc.setdefault("commands", []).append("python " + shlex.join(sys.argv))
    doc.update(gpu=gpu_name(), versions=versions(), loads=LOADS, model=model.name if model.real else "llama8b (random)")
    for label, label_loads in plan:
        t0 = time.monotonic()
        doc["runs"][label] = run_backend(
            label, model, out, label_loads, json.loads(args.sparse_config),
            args.port, t_start + args.deadline, args.repeat_baseline if label == "FLASH_ATTN" else args.repeat,
            args.chunk, dict((name, json.loads(fields)) for name, fields in args.variant),
        )
        doc["runs"][label]["wall_s"] = round(time.monotonic() - t0, 1)
        path.write_text(json.dumps(doc, indent=1))
        doc["summary"] = summarise(doc["runs"])
        path.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc["summary"], indent=1))


if __name__ == "__main__":
    main()
