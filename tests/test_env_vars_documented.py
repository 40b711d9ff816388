"""Every environment variable the package reads (its Python and its native CPU kernels) has a row in the README's
table (Configuration, Environment variables), and the table names none the package no longer reads."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\b((?:VLLM_SPARSE|SPARSE_ATTENTION)_[A-Z0-9_]+)\b")


def _read_by_package() -> set[str]:
    names = set()
    sources = [*(ROOT / "vllm_sparse").rglob("*.py"), *(ROOT / "csrc").rglob("*.[ch]*")]  # Python and native kernels
    for path in sources:
        names |= {m for m in NAME.findall(path.read_text()) if not m.endswith("_")}
    return names


def _table() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Environment variables", 1)[1].split("\n## ", 1)[0]
    return {m for line in section.splitlines() if line.startswith("| `") for m in NAME.findall(line.split("|")[1])}


def test_every_variable_read_has_a_row_and_every_row_is_read():
    read, rows = _read_by_package(), _table()
    assert "SPARSE_ATTENTION_CONFIG" in read and "VLLM_SPARSE_CACHE" in read  # the scan finds them at all
    assert read - rows == set(), f"add README rows for {sorted(read - rows)}"
    assert rows - read == set(), f"the README documents variables the package no longer reads: {sorted(rows - read)}"
