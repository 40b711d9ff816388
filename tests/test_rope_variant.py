"""``NAME@yarnF`` (vllm_sparse.eval.rope_variant): a model folder's YaRN-scaled twin, no network, no real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_sparse.config import match_shipped_config
from vllm_sparse.eval.models import UnknownModelError, check_context, model_max_context, resolve_model
from vllm_sparse.eval.rope_variant import MARKER_FILE, split_rope_suffix, yarn_folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_SPARSE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _model(folder: Path, config: dict | None = None) -> Path:
    """A model folder as the converter writes it (transformers 5: rope_theta inside rope_parameters)."""
    folder.mkdir(parents=True)
    config = config or {"model_type": "qwen2", "max_position_embeddings": 32768,
                        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32768, "eos_token": "<e>"}))
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "tokenizer.json").write_text("{}")
    (folder / ".vllm_sparse_complete.json").write_text("{}")
    return folder


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("qwen2.5-coder-1.5b-instruct", ("qwen2.5-coder-1.5b-instruct", None)),
        ("qwen2.5-coder-1.5b-instruct@yarn4", ("qwen2.5-coder-1.5b-instruct", 4.0)),
        ("/models/m@yarn2.5", ("/models/m", 2.5)),
    ],
)
def test_split_rope_suffix(name: str, expected: tuple[str, float | None]) -> None:
    assert split_rope_suffix(name) == expected


@pytest.mark.parametrize("name", ["m@yarn", "m@yarnx", "m@yarn1", "m@yarn0.5", "@yarn4"])
def test_bad_suffix_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="yarn"):
        split_rope_suffix(name)


def test_yarn_folder_scales_the_window_and_links_the_rest(cache: Path, tmp_path: Path) -> None:
    base = _model(tmp_path / "qwen2.5-coder-1.5b-instruct")
    out = yarn_folder(base, 4.0)
    assert out.name == base.name, "the last path component stays the model's (its shipped config must match)"
    assert cache in out.parents
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 131072
    assert config["rope_parameters"] == {"rope_theta": 1000000.0, "rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 32768}  # fmt: skip
    assert "rope_scaling" not in config
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"model_max_length": 131072, "eos_token": "<e>"}
    for name in ("model.safetensors", "tokenizer.json"):
        assert (out / name).is_symlink() and (out / name).resolve() == (base / name).resolve()
    assert not (out / ".vllm_sparse_complete.json").exists(), "the base's own marker is not carried over"
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["base"] == str(base.resolve()) and marker["factor"] == 4.0
    assert json.loads((base / "config.json").read_text())["max_position_embeddings"] == 32768, "base untouched"
    # built once: a second call finds the marker and leaves the folder as it is
    stamp = (out / "config.json").stat().st_mtime_ns
    assert yarn_folder(base, 4.0) == out and (out / "config.json").stat().st_mtime_ns == stamp
    assert yarn_folder(base, 2.0) != out, "another factor is another folder"


def test_transformers4_config_gets_rope_scaling(cache: Path, tmp_path: Path) -> None:
    base = _model(tmp_path / "m", {"model_type": "llama", "max_position_embeddings": 8192, "rope_theta": 5e5})
    config = json.loads((yarn_folder(base, 2.0) / "config.json").read_text())
    assert config["rope_scaling"] == {"type": "yarn", "rope_type": "yarn", "factor": 2.0,
                                      "original_max_position_embeddings": 8192}  # fmt: skip
    assert config["max_position_embeddings"] == 16384 and config["rope_theta"] == 5e5


@pytest.mark.parametrize(
    "config",
    [
        {"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
        {"max_position_embeddings": 8192, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0}},
        {"rope_parameters": {"rope_type": "default"}},
    ],
)
def test_refused_configs(cache: Path, tmp_path: Path, config: dict) -> None:
    base = _model(tmp_path / "m", config)
    with pytest.raises(ValueError, match="already scales RoPE|max_position_embeddings"):
        yarn_folder(base, 2.0)
    assert not (cache / "rope").exists() or not any((cache / "rope").rglob("config.json"))


def test_resolve_model_serves_the_suffix(cache: Path, tmp_path: Path) -> None:
    base = _model(tmp_path / "qwen2.5-coder-0.5b-instruct")
    path = resolve_model(f"{base}@yarn4")
    assert Path(path) == yarn_folder(base, 4.0)
    assert model_max_context(path) == 131072
    assert check_context(path, 131072) == 131072
    with pytest.raises(ValueError, match="longer than"):
        check_context(str(base), 65536)
    shipped = match_shipped_config(path)
    assert shipped is not None and shipped[0].name == "qwen2.5-coder-0.5b-instruct.yaml"
    with pytest.raises(UnknownModelError, match="yarn"):
        resolve_model(f"{base}@yarnfour")
