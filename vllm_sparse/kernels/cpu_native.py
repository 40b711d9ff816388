"""Native CPU kernels (``csrc/*.cpp``, installed as ``vllm_sparse.csrc``: QuoKA, Quest, Kascade): JIT-built against the imported torch.

The C++ sources ship inside the package and are compiled (into one library) on first use with the system's C++
compiler (``$CXX``, else ``c++``) against the headers and libraries of whatever torch is imported,
so the library always matches the user's torch (no build isolation, no prebuilt wheel). The
result is cached in ``$VLLM_SPARSE_CACHE/ext/<key>/`` (default ``~/.cache/vllm-sparse/ext``), the key
being the torch version and commit, the C++ ABI, the machine type and a hash of the sources and
flags. A build runs under an exclusive file lock and writes to a temporary file that is renamed
into place, so concurrent processes (vLLM workers) build once and never load a half-written file.
The AVX-512 code paths are picked at run time, so one build serves every x86-64 CPU.

Without a compiler, or when the build fails, everything runs on the torch path and the
``vllm_sparse`` logger warns once per process with the reason. ``VLLM_SPARSE_NATIVE=0`` forces the
torch path (no build, no warning).

Ops (``torch.ops.vllm_sparse_cpu``), each with a torch twin that ``tests/test_cpu_native.py``
compares against: :func:`quoka_score`, :func:`masked_topk`, :func:`quoka_score_topk`
(``csrc/quoka_cpu.cpp``), :func:`quest_bounds`, :func:`quest_bounds_rows` (``csrc/quest_cpu.cpp``),
:func:`anchor_page_mass` (``csrc/kascade_cpu.cpp``), :func:`page_minmax_write` (``csrc/page_meta_cpu.cpp``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from vllm_sparse.resources import data_dir

logger = logging.getLogger("vllm_sparse")

CSRC = data_dir("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))  # every source goes into the one library
HEADERS = sorted(CSRC.glob("*.h"))
LIB_NAME = "vllm_sparse_cpu"
_FLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-DNDEBUG"]

_state: dict = {}  # "ops": the op namespace or None once decided; "reason": why not
_off = [0]  # > 0 inside torch_path()


def enabled_by_env() -> bool:
    """False when ``VLLM_SPARSE_NATIVE=0`` (or ``false``/``off``/``no``) forces the torch path."""
    return os.environ.get("VLLM_SPARSE_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """Where built libraries live: ``$VLLM_SPARSE_CACHE/ext`` or ``~/.cache/vllm-sparse/ext``."""
    base = os.environ.get("VLLM_SPARSE_CACHE") or Path.home() / ".cache" / "vllm-sparse"
    return Path(base) / "ext"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    path = shutil.which(cxx)
    if path is None:
        raise RuntimeError(f"no C++ compiler found (looked for {cxx!r}; set CXX)")
    return path


def _build_command(cxx: str, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = library_paths()
    cmd = [cxx, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += [f"-I{p}" for p in include_paths()]
    cmd += [str(src) for src in SOURCES] + ["-o", str(out)]
    cmd += [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs] + ["-lc10", "-ltorch_cpu"]
    return cmd


def build_key(cxx: str) -> str:
    """``torch<version>-<commit>-<machine>-<hash of sources, flags, ABI, compiler>``."""
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    h.update(repr((_FLAGS, torch._C._GLIBCXX_USE_CXX11_ABI, cxx, sys.version_info[:2])).encode())
    commit = (torch.version.git_version or "")[:8]
    return f"torch{torch.__version__}-{commit}-{platform.machine()}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _lock(path: Path):
    """Hold an exclusive lock on ``path`` for the block (no-op off POSIX); the kernel releases it
    if the process dies, so a crashed build never blocks the next one."""
    with open(path, "a+") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:
            pass
        yield


def build(timeout: float = 900.0) -> Path:
    """Compile the library if it is not cached yet; returns its path. Raises on any failure."""
    cxx = _compiler()
    folder = cache_dir() / build_key(cxx)
    lib = folder / f"{LIB_NAME}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with _lock(folder / "build.lock"):
        if lib.exists():  # another process built it while we waited
            return lib
        fd, tmp = tempfile.mkstemp(prefix=f".{LIB_NAME}-", suffix=".so", dir=folder)
        os.close(fd)
        try:
            cmd = _build_command(cxx, Path(tmp))
            logger.info("vllm-sparse: building native CPU kernels into %s", folder)
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                log = folder / "build.log"
                log.write_text(" ".join(cmd) + "\n\n" + proc.stdout + proc.stderr)
                lines = proc.stderr.strip().splitlines() or ["(no output)"]
                tail = next((x for x in lines if "error" in x), lines[-1]).strip()[:300]
                raise RuntimeError(f"{Path(cxx).name} failed (exit {proc.returncode}: {tail}; full log {log})")
            os.chmod(tmp, 0o755)  # mkstemp made it private
            os.replace(tmp, lib)  # atomic: readers see no file or the whole file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return lib


def load():
    """The op namespace ``torch.ops.vllm_sparse_cpu``, or ``None`` on the torch path.

    Decided once per process: builds (or finds) the library and loads it; on failure logs one
    warning with the reason and returns ``None`` from then on.
    """
    if "ops" in _state:
        return _state["ops"]
    ops, reason = None, None
    if not enabled_by_env():
        reason = "VLLM_SPARSE_NATIVE=0"
    elif platform.system() != "Linux":
        reason = f"native CPU kernels are built on Linux only (this is {platform.system()})"
    else:
        try:
            path = build()
            if not hasattr(torch.ops, LIB_NAME) or not hasattr(getattr(torch.ops, LIB_NAME), "quest_bounds"):
                torch.ops.load_library(str(path))
            ops = getattr(torch.ops, LIB_NAME)
        except Exception as e:  # noqa: BLE001 -- any failure means: run the torch path
            reason = f"{type(e).__name__}: {e}"
            logger.warning("vllm-sparse: native CPU kernels unavailable, using the torch path (%s)", reason)
    if reason == "VLLM_SPARSE_NATIVE=0":
        logger.info("vllm-sparse: native CPU kernels disabled by VLLM_SPARSE_NATIVE=0")
    _state.update(ops=ops, reason=reason)
    return ops


def available() -> bool:
    """True when the native ops are loaded (building them on first call)."""
    return load() is not None


def usable(*tensors: torch.Tensor) -> bool:
    """True when the native ops apply: every tensor on the CPU, the library loaded, and not inside
    :func:`torch_path`."""
    return not _off[0] and all(t.device.type == "cpu" for t in tensors) and available()


@contextlib.contextmanager
def torch_path():
    """Inside this block the selectors take the torch path (A/B benchmarks and tests)."""
    _off[0] += 1
    try:
        yield
    finally:
        _off[0] -= 1


def quoka_score(qbar: torch.Tensor, page_keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """QuoKA page scores, keys read in place. Twin: ``selectors.quoka.score_pages(qbar, page_keys[ids])``.

    Args:
        qbar: ``float32 [Hkv, nq, D]`` grouped unit queries (``selectors.quoka.group_query``).
        page_keys: ``[num_pages, N, D]`` float32/bfloat16/float16 keys by physical page id, any
            strides (``PageLayout.page_keys``; channel-major ``planes`` pages take the fast path).
        ids: ``int [Hkv, P]`` physical page ids to score per KV head.
    Returns:
        ``float32 [Hkv, P]``: max over queries and the page's tokens of ``cos(q, k)``.
    """
    return load().quoka_score(qbar.float().contiguous(), page_keys, ids.long().contiguous())


def _excluded(excluded: torch.Tensor) -> torch.Tensor:
    return excluded.contiguous() if excluded.dtype == torch.bool else excluded.long().contiguous()


def masked_topk(scores: torch.Tensor, excluded: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` columns per row, excluded entries never picked; ``int64 [H, k]``, best first.

    Args:
        scores: ``float32 [H, P]``.
        excluded: ``int [F]`` columns excluded in every row, or a ``bool [H, P]`` mask.
        k: ``0 <= k <= P``.
    Twin: ``s = scores.clone(); s[:, excluded] = -inf`` (or ``s[excluded] = -inf`` for a mask);
    ``torch.topk(s, k).indices``. Ties go to the lower column; NaN ranks first (as in torch.topk).
    """
    return load().masked_topk(scores.float().contiguous(), _excluded(excluded), int(k))


def quoka_score_topk(
    qbar: torch.Tensor, page_keys: torch.Tensor, ids: torch.Tensor, excluded: torch.Tensor, k: int
) -> torch.Tensor:
    """:func:`quoka_score` then :func:`masked_topk`, fused: ``int64 [Hkv, k]`` indices into ``ids``' columns.

    Args:
        qbar, page_keys, ids: as in :func:`quoka_score` (``ids`` rows may be any (request, KV head)
            rows, as long as ``qbar`` has one row of queries for each).
        excluded: ``int [F]`` columns (logical past pages: sink, local window) never selected, or a
            ``bool [Hkv, P]`` mask of them per row.
        k: pages to keep per row, ``0 <= k <= P``.
    """
    return load().quoka_score_topk(
        qbar.float().contiguous(), page_keys, ids.long().contiguous(), _excluded(excluded), int(k)
    )


def _quest_planes(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if kmin.stride(-1) != 1 or kmax.stride(-1) != 1 or kmin.dtype != kmax.dtype:
        kmin, kmax = kmin.contiguous(), kmax.to(kmin.dtype).contiguous()  # (the planes never need this)
    return kmin, kmax


def quest_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Quest bounds of one request's queries, summaries read in place from the metadata planes.

    Twin: ``selectors.quest.page_upper_bounds(q, kmin[blocks].transpose(0, 1), kmax[blocks].transpose(0, 1))``.

    Args:
        q: ``[C, Hq, D]`` the chunk's queries (any float dtype; computed in float32).
        kmin, kmax: ``[num_blocks, Hkv, D]`` float32/bfloat16/float16 planes (``PageMeta.kmin/kmax``).
        blocks: ``int [P]`` physical block of each page.
    Returns:
        ``float32 [Hkv, G, P]``: per query head, ``max_c sum_d max(q * kmax, q * kmin)`` (before the
        GQA reduction).
    """
    kmin, kmax = _quest_planes(kmin, kmax)
    return load().quest_bounds(q.float().contiguous()[None], kmin, kmax, blocks.long().reshape(1, -1).contiguous())


def quest_bounds_rows(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Quest bounds of one query per slot (decode request) over the slot's pages, in one call.

    Twin: ``selectors.quest.page_upper_bounds_rows(q, kmin, kmax, blocks)``.

    Args:
        q: ``[S, Hq, D]`` one query per slot.
        kmin, kmax: ``[num_blocks, Hkv, D]`` the metadata planes.
        blocks: ``int [S, P]`` physical block of each page of each slot.
    Returns:
        ``float32 [S * Hkv, G, P]``, row ``slot * Hkv + kv_head``.
    """
    kmin, kmax = _quest_planes(kmin, kmax)
    return load().quest_bounds(q.float().contiguous()[:, None], kmin, kmax, blocks.long().contiguous())


def page_minmax_write(keys: torch.Tensor, slot_mapping: torch.Tensor, meta) -> bool:
    """Quest's page summaries of every page written this step, in one call; False (nothing written) where the
    native op does not apply (planes not in the cache dtype), so that the caller takes the torch path.

    Twin: ``metadata.page_minmax.write_page_minmax``'s torch path (the same min/max and INT8 codes).

    Args:
        keys: ``[num_blocks, Hkv, N, D]`` the cache's keys (``PageLayout.keys``), this step's written.
        slot_mapping: ``int [T]`` slots ``block * N + offset`` written this step; negative: padding.
        meta: ``layout.PageMeta``: ``kmin``/``kmax`` ``[num_blocks, Hkv, D]`` written in place, and
            ``kmin8``/``kmax8``/``mscale`` where kept.
    """
    if meta.kmin.dtype != keys.dtype or meta.kmax.dtype != keys.dtype:
        return False
    load().page_minmax_write(keys, slot_mapping.long().contiguous(), meta.kmin, meta.kmax, meta.kmin8, meta.kmax8,
                             meta.mscale)  # fmt: skip
    return True


def anchor_page_mass(
    q: torch.Tensor,
    page_keys: torch.Tensor,
    page_ids: torch.Tensor,
    context_len: int,
    scale: float,
    tile: int,
    stride: int = 1,
) -> torch.Tensor:
    """Kascade's pooled post-softmax mass of each past page, keys read in place (``csrc/kascade_cpu.cpp``).

    Twin: ``kernels.anchor_mass.anchor_page_mass`` (same arguments, same result up to float rounding).

    Args:
        q: ``[C, Hq, D]`` queries at positions ``context_len .. context_len + C - 1`` (any float dtype;
            computed in float32).
        page_keys: ``[num_pages, N, D]`` float32/bfloat16/float16 keys by physical page id, any strides.
        page_ids: ``int [Hkv, P]`` physical page id of each logical page, ``P >= ceil((context_len + C - 1) / N)``.
        context_len: tokens before the first query.
        scale: softmax scale.
        tile: queries per tile; stride: score the last tile and every ``stride``-th before it.
    Returns:
        ``float32 [Hkv, context_len // N]``: per KV head and past page, the largest over scored tiles of the
        mean over the tile's (query, query head) rows of the page's softmax weight.
    """
    return load().anchor_page_mass(
        q.float().contiguous(), page_keys, page_ids.long().contiguous(), int(context_len), float(scale), int(tile),
        int(stride),
    )  # fmt: skip
