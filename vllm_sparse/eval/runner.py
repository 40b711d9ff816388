"""Run the accuracy tasks through vLLM: one engine per backend, all of a backend's samples in one ``generate``.

The backends are the platform's dense one (``CPU_ATTN`` on CPU, ``FLASH_ATTN`` on a GPU) and every
implemented sparse method at each budget, configured through
``additional_config={"sparse_attention": {...}}``. Decoding is greedy. Only vLLM's public ``LLM`` API is
used. vLLM starts its engine in a spawned process, so a script calling :func:`run_eval` must do so under
``if __name__ == "__main__":`` (checked, with a clear error).

Example::

    from vllm_sparse.eval import EvalConfig, run_eval

    if __name__ == "__main__":
        result = run_eval(EvalConfig(model="qwen2.5-coder-0.5b-instruct", contexts=(4096,), samples=2))
        print(result.markdown)
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_sparse.eval.models import check_context, resolve_model
from vllm_sparse.eval.tasks import DEFAULT_DEPTHS, TASKS, Sample, make_samples


@dataclass(frozen=True)
class Backend:
    """One engine configuration: an attention backend and, for sparse ones, the ``sparse_attention`` config.

    ``label`` names it in results (``CPU_ATTN``, ``sparse_quoka@0.125``).
    """

    label: str
    name: str
    sparse: dict[str, Any] | None = None

    @property
    def is_sparse(self) -> bool:
        return self.name.lower().startswith("sparse_")

    @property
    def method(self) -> str:
        return self.name.lower().removeprefix("sparse_") if self.is_sparse else "dense"

    @property
    def budget(self) -> float | None:
        """The budget fraction, or None for dense backends."""
        return (self.sparse or {}).get("budget", {}).get("fraction") if self.is_sparse else None

    def additional_config(self) -> dict[str, Any]:
        return {"sparse_attention": self.sparse} if self.is_sparse and self.sparse is not None else {}


def dense_backend_name() -> str:
    """The platform's dense backend: ``FLASH_ATTN`` with a CUDA GPU, ``CPU_ATTN`` otherwise."""
    import torch

    return "FLASH_ATTN" if torch.cuda.is_available() else "CPU_ATTN"


SAMPLES_GPU = 20  # per (task, context): what the issue asks of recorded runs, cheap on a GPU
SAMPLES_CPU = 2  # a CPU engine takes about a minute per sample and backend


def default_samples() -> int:
    """Samples per task and context when none are asked for: ``SAMPLES_GPU`` with a CUDA GPU,
    ``SAMPLES_CPU`` otherwise."""
    import torch

    return SAMPLES_GPU if torch.cuda.is_available() else SAMPLES_CPU


def implemented_methods() -> tuple[str, ...]:
    """Sparse methods that have a selector (``quoka``, ...)."""
    from vllm_sparse.selectors import IMPLEMENTED_METHODS

    return tuple(IMPLEMENTED_METHODS)


def default_backends(
    methods: Sequence[str] | None = None,
    budgets: Sequence[float] = (0.125, 0.25),
    min_tokens: int | None = None,
    extra: dict[str, Any] | None = None,
    dense: str | None = None,
) -> list[Backend]:
    """The dense backend, then ``sparse_<method>@<budget>`` for every method and budget fraction.

    Args:
        methods: sparse methods (default: every implemented one).
        budgets: budget fractions of the context.
        min_tokens: the budget's ``min_tokens``; None sets none, so that ``extra``'s (a variant's) or the model's
            config's holds (the schema's 1024 where neither sets one).
        extra: further ``sparse_attention`` fields for every sparse backend (e.g. ``dense_below_tokens``).
        dense: the dense backend's name (default: :func:`dense_backend_name`).
    """
    methods = implemented_methods() if methods is None else tuple(methods)
    known = implemented_methods()
    for m in methods:
        if m not in known:
            raise ValueError(f"sparse method {m!r} is not implemented; implemented: {', '.join(known)}")
    out = [Backend(dense or dense_backend_name(), dense or dense_backend_name())]
    for m in methods:
        for b in budgets:
            budget = {**(extra or {}).get("budget", {}), "fraction": b}
            if min_tokens is not None:
                budget["min_tokens"] = min_tokens
            cfg = {**(extra or {}), "budget": budget}
            out.append(Backend(f"sparse_{m}@{b:g}", f"sparse_{m}", cfg))
    return out


@dataclass
class EvalConfig:
    """Everything a run needs; the defaults are the small CPU run."""

    model: str
    tasks: Sequence[str] = tuple(TASKS)
    contexts: Sequence[int] = (4096,)
    samples: int = 2
    depths: Sequence[float] = DEFAULT_DEPTHS
    seed: int = 0
    backends: Sequence[Backend] | None = None  # None: default_backends()
    dtype: str = "bfloat16"
    block_size: int = 32
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 8
    kv_cache_memory_bytes: int = 2 << 30
    gpu_memory_utilization: float = 0.5  # on a GPU, lower it to run several evals side by side
    sparse_only: bool = False  # no dense engine: the run is joined later to one that has it (eval/join.py)
    out_dir: str = "eval_results"
    progress: bool = True
    command: str | None = None  # recorded in the report; default: this process's argv


@dataclass
class BackendRun:
    """Per-backend outcome: the sample records and how long the engine took."""

    backend: Backend
    records: list[dict[str, Any]]
    start_s: float
    generate_s: float
    page_counters: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalResult:
    config: EvalConfig
    model_path: str
    samples: list[Sample]
    runs: list[BackendRun]
    files: dict[str, str] = field(default_factory=dict)
    markdown: str = ""


def _check_spawn_guard() -> None:
    """Refuse to start engines from a process that is itself a spawned child re-running ``__main__``."""
    main = sys.modules.get("__main__")
    if multiprocessing.parent_process() is not None and getattr(main, "__name__", "") == "__mp_main__":
        raise RuntimeError(
            "run_eval was called while a spawned process re-imported your script. vLLM starts its engine "
            'with spawn: call run_eval under `if __name__ == "__main__":`.'
        )


def build_samples(tokenizer, config: EvalConfig) -> list[Sample]:
    """Every sample of the run, task by task and context by context."""
    return [
        s
        for ctx in config.contexts
        for task in config.tasks
        for s in make_samples(tokenizer, task, ctx, config.samples, config.depths, config.seed)
    ]


def run_backend(model_path: str, backend: Backend, samples: Sequence[Sample], tokenizer, config: EvalConfig,
                stats_path: Path) -> BackendRun:  # fmt: skip
    """Start one engine for ``backend``, generate every sample in one call, score, shut the engine down."""
    from tqdm.auto import tqdm
    from vllm import LLM, SamplingParams

    from vllm_sparse.stats import STATS_ENV, read_stats

    stats_path.unlink(missing_ok=True)
    os.environ[STATS_ENV] = str(stats_path)  # read by the engine's worker process, which inherits it
    started = time.perf_counter()
    llm = LLM(
        model=model_path,
        attention_backend=backend.name,
        additional_config=backend.additional_config(),
        dtype=config.dtype,
        block_size=config.block_size,
        max_model_len=max(config.contexts),
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        enforce_eager=True,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        seed=config.seed,
    )
    start_s = time.perf_counter() - started
    prompts = [{"prompt_token_ids": tokenizer.encode(s.prompt, add_special_tokens=False)} for s in samples]
    params = [SamplingParams(max_tokens=s.max_tokens, temperature=0.0) for s in samples]

    def bar(*args, **kwargs):
        return tqdm(*args, **{**kwargs, "desc": f"{backend.label}"})

    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=bar if config.progress else False)
    generate_s = time.perf_counter() - started
    del llm
    gc.collect()
    os.environ.pop(STATS_ENV, None)

    records = []
    for s, out in zip(samples, outputs, strict=True):
        text = out.outputs[0].text
        records.append({
            "backend": backend.label, "attention_backend": backend.name, "method": backend.method,
            "budget": backend.budget, "task": s.task, "context": s.context, "index": s.index,
            "depth": s.depth, "seed": s.seed, "prompt_hash": s.prompt_hash, "prompt_tokens": s.prompt_tokens,
            "haystack": s.haystack, "expected": list(s.expected), "output": text, "score": s.score(text),
            **({"details": d} if (d := s.details(text)) else {}),
        })  # fmt: skip
    counters = read_stats(str(stats_path)) if backend.is_sparse else {}
    return BackendRun(backend, records, round(start_s, 1), round(generate_s, 1), counters)


def run_eval(config: EvalConfig) -> EvalResult:
    """Resolve the model, check the context, build the samples, run every backend, write the report.

    Raises:
        models.UnknownModelError: the model is neither known nor a local folder.
        ValueError: a context is longer than the model supports, or a task/method is unknown.
    """
    from transformers import AutoTokenizer

    from vllm_sparse.eval.report import write_report

    _check_spawn_guard()
    for task in config.tasks:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    model_path = resolve_model(config.model, progress=config.progress)
    check_context(model_path, max(config.contexts))
    backends = list(config.backends) if config.backends is not None else default_backends()
    labels = [b.label for b in backends]
    if len(set(labels)) != len(labels):
        raise ValueError(f"backend labels must be unique, got {labels}")
    has_dense = any(not b.is_sparse for b in backends)
    if config.sparse_only and has_dense:
        raise ValueError("sparse_only: the backends must not include a dense one")
    if not config.sparse_only and not has_dense:
        raise ValueError(
            "the backends must include a dense one: the report compares every sparse one with it "
            "(or run sparse_only and join the folder to a run that has dense: python -m vllm_sparse.eval.join)"
        )
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # Engines start from a parent that has loaded torch (and may have touched CUDA): fork would
    # fail on GPUs with "Cannot re-initialize CUDA in forked subprocess".
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    samples = build_samples(tokenizer, config)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = EvalResult(config, model_path, samples, [])
    for i, backend in enumerate(backends, start=1):
        print(f"[vllm-sparse eval] backend {i}/{len(backends)}: {backend.label} ({len(samples)} samples)", flush=True)
        result.runs.append(run_backend(model_path, backend, samples, tokenizer, config, out_dir / ".stats.json"))
        write_report(result)  # after every backend, so an interrupted run keeps what it measured
    (out_dir / ".stats.json").unlink(missing_ok=True)
    return result


def config_dict(config: EvalConfig) -> dict[str, Any]:
    """The config as plain JSON-able data."""
    d = asdict(config)
    d["backends"] = [asdict(b) for b in config.backends] if config.backends is not None else None
    return d
