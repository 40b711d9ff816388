"""Shipped selector configs (``configs/``): one per supported model family, valid for every implemented
backend on that model's architecture, matched by hub name or local path (case-insensitive), listed by
the CLI, and logged at engine start."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import yaml

from vllm_sparse import config as cfgmod
from vllm_sparse.cli import main
from vllm_sparse.config import (
    ENV_VAR,
    SparseConfig,
    match_shipped_config,
    parse_config,
    resolve_config,
    shipped_config_path,
    shipped_configs,
)

# Each family's config.json: hub name -> (file, num_hidden_layers, num_attention_heads, num_key_value_heads,
# head_dim). Qwen2.5 and Mistral have no head_dim key: hidden_size / num_attention_heads (3584/28, 1536/12,
# 896/14, 4096/32); Llama-3.x, Qwen3 state head_dim 128.
MODELS = {
    "meta-llama/Llama-3.1-8B-Instruct": ("llama-3.1-8b-instruct.yaml", 32, 32, 8, 128),
    "meta-llama/Llama-3.2-3B-Instruct": ("llama-3.2-3b-instruct.yaml", 28, 24, 8, 128),
    "Qwen/Qwen2.5-7B-Instruct": ("qwen2.5-7b-instruct.yaml", 28, 28, 4, 128),
    "Qwen/Qwen3-8B": ("qwen3-8b.yaml", 36, 32, 8, 128),
    "mistralai/Mistral-7B-Instruct-v0.3": ("mistral-7b-instruct-v0.3.yaml", 32, 32, 8, 128),
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": ("qwen2.5-coder-0.5b-instruct.yaml", 24, 14, 2, 64),
    "Qwen/Qwen2.5-Coder-1.5B-Instruct": ("qwen2.5-coder-1.5b-instruct.yaml", 28, 12, 2, 128),
}
METHODS = ("quoka", "quest", "twilight")  # the implemented backends
SHAPE_COMMENT = re.compile(r"(\d+) layers, (\d+) query heads, (\d+) KV heads, head_dim (\d+)")


def _load(hub: str) -> tuple[str, dict]:
    path = shipped_config_path(hub)
    assert path is not None, f"no shipped config matches {hub}"
    return path.name, yaml.safe_load(path.read_text())


def test_every_shipped_file_is_a_known_model():
    """A new file in configs/ must be added to MODELS (so that it is validated against its shapes)."""
    shipped = {p.name for p in cfgmod.SHIPPED_DIR.glob("*.yaml")}
    assert shipped == {v[0] for v in MODELS.values()}


@pytest.mark.parametrize("hub", list(MODELS))
def test_family_matched_by_hub_name_and_local_paths(hub):
    file = MODELS[hub][0]
    short = hub.split("/")[-1]
    for model in (hub, hub.lower(), hub.upper(), f"/models/{short.lower()}", f"/models/{short}/", short.upper()):
        found = match_shipped_config(model)
        assert found is not None and found[0].name == file, (model, found)
    r = resolve_config("quest", hub, environ={})
    assert r.source.startswith(f"shipped {file} ("), r.source


@pytest.mark.parametrize("hub", list(MODELS))
@pytest.mark.parametrize("method", METHODS)
def test_config_fits_the_architecture_for_every_backend(hub, method):
    file, layers, heads, kv_heads, head_dim = MODELS[hub]
    name, data = _load(hub)
    cfg = parse_config(data, method, name)  # raises SparseConfigError on any invalid field
    assert cfg.method == method
    assert cfg.model_reasons(layers) == []
    for idx in [*cfg.dense_layers, *cfg.layers]:
        assert 0 <= idx < layers, f"{file}: layer {idx} does not exist in {hub} ({layers} layers)"
    # Some layers must run sparse, else the config turns the backend into dense attention.
    sparse_layers = [i for i in range(layers) if not cfg.for_layer(i).dense]
    assert len(sparse_layers) >= layers // 2, f"{file}: only {len(sparse_layers)} of {layers} layers sparse"
    # The per-KV-head budget must leave room for selection: below the whole context at 32K.
    assert cfg.budget.tokens(32768) < 32768
    # The file's header comment states the same shapes as the model's config.json above.
    shape = SHAPE_COMMENT.search((cfgmod.SHIPPED_DIR / file).read_text().splitlines()[0])
    assert shape is not None, f"{file}: first comment must state the model's shapes"
    assert tuple(int(x) for x in shape.groups()) == (layers, heads, kv_heads, head_dim), file
    assert heads % kv_heads == 0 and heads // kv_heads > 1, f"{hub} is not GQA"


@pytest.mark.parametrize("hub", list(MODELS))
def test_every_setting_states_its_source(hub):
    """Every top-level setting carries a comment saying whether it is the schema default, a paper's
    operating point or our measurement (or, for ``models``, what the names are)."""
    file = MODELS[hub][0]
    settings = [ln for ln in (cfgmod.SHIPPED_DIR / file).read_text().splitlines() if ln and ln[0] not in "# "]
    assert settings, file
    for line in settings:
        comment = line.partition("#")[2]
        assert re.search(r"default|paper|measure|hub names", comment, re.I), f"{file}: {line!r} states no source"


def test_models_key_has_no_effect_on_the_policy():
    with_names = parse_config({"models": ["Org/Some-Model"], "budget": {"fraction": 0.25}}, "quest", "t")
    without = parse_config({"budget": {"fraction": 0.25}}, "quest", "t")
    assert with_names.models == ["Org/Some-Model"]
    for i in range(4):
        assert with_names.for_layer(i) == without.for_layer(i)
    assert SparseConfig().models == []


def test_unknown_models_get_none_and_defaults():
    for model in ("someone/unknown-model-7b", "/models/qwen3-8b/extra", "Qwen/Qwen3", "", None, "/"):
        assert match_shipped_config(model) is None, model
    r = resolve_config("quoka", "someone/unknown-model-7b", environ={})
    assert r.source == "defaults (no shipped config matches the model)"
    assert r.config == SparseConfig(method="quoka")


def test_matching_is_case_insensitive_and_uses_the_models_list():
    assert shipped_config_path("QWEN/QWEN3-8B").name == "qwen3-8b.yaml"
    assert shipped_config_path("qwen/qwen3-8b").name == "qwen3-8b.yaml"
    # an old hub name listed in the file's models, not its file name
    path, why = match_shipped_config("META-LLAMA/Meta-Llama-3.1-8B-Instruct")
    assert path.name == "llama-3.1-8b-instruct.yaml" and "models list" in why
    path, why = match_shipped_config("/data/meta-llama-3.1-8b-instruct")
    assert path.name == "llama-3.1-8b-instruct.yaml" and "last component" in why
    path, why = match_shipped_config("Qwen/Qwen3-8B")
    assert "file name" in why


def _ship(tmp_path, files: dict[str, dict]):
    for name, data in files.items():
        (tmp_path / name).write_text(yaml.safe_dump(data))


def test_rule_order_file_name_then_exact_model_then_last_component(tmp_path, monkeypatch):
    monkeypatch.setattr(cfgmod, "SHIPPED_DIR", tmp_path)
    _ship(
        tmp_path,
        {
            "a.yaml": {"models": ["org/b", "other/c"], "sink_tokens": 1},
            "b.yaml": {"sink_tokens": 2},
            "d.yaml": {"models": ["org/c"], "sink_tokens": 4},
        },
    )
    # "org/b": a.yaml lists it exactly, but b.yaml's file name equals the last component: b wins.
    assert match_shipped_config("org/b")[0].name == "b.yaml"
    assert resolve_config("quoka", "ORG/B", environ={}).config.sink_tokens == 2
    # "org/c": d.yaml lists it exactly; a.yaml (sorted first) only by last component: d wins.
    assert match_shipped_config("Org/C")[0].name == "d.yaml"
    # "/x/c": no exact name; the first config whose models end in "c".
    assert match_shipped_config("/x/c")[0].name == "a.yaml"
    assert match_shipped_config("org/e") is None


def test_cli_lists_every_shipped_config_with_its_names(capsys):
    assert main(["show-config", "--list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":", 1)[0]: line for line in out.splitlines() if line.strip()}
    assert set(lines) == {v[0] for v in MODELS.values()}
    for hub, (file, *_) in MODELS.items():
        assert hub in lines[file], (hub, lines[file])
    assert "meta-llama/Meta-Llama-3.1-8B-Instruct" in lines["llama-3.1-8b-instruct.yaml"]
    for path, names in shipped_configs().items():  # file stem, then its models list
        assert names[0] == path.stem and all(n in lines[path.name] for n in names)


def test_cli_show_config_for_a_model_still_resolves(capsys, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert main(["show-config", "--model", "mistralai/Mistral-7B-Instruct-v0.3", "--backend", "sparse_twilight"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# source: shipped mistral-7b-instruct-v0.3.yaml (")
    shown = yaml.safe_load(out)
    assert shown["method"] == "twilight" and shown["dense_layers"] == [0, 1]


@pytest.mark.parametrize(
    "model,expect",
    [
        ("Qwen/Qwen3-8B", "shipped qwen3-8b.yaml (file name"),
        ("someone/unknown-model-7b", "defaults (no shipped config matches the model)"),
    ],
)
def test_engine_start_logs_the_chosen_config(model, expect, caplog, monkeypatch):
    from vllm_sparse.backend import startup

    monkeypatch.delenv(ENV_VAR, raising=False)
    startup._resolve_cached.cache_clear()
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=model), additional_config={})
    with caplog.at_level(logging.INFO, logger="vllm_sparse"):
        startup.load_config("quest", vllm_config)
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm_sparse" and r.levelno == logging.INFO]
    assert len(lines) == 1 and expect in lines[0], lines
    startup._resolve_cached.cache_clear()


KASCADE_CALIBRATED = (
    "meta-llama/Llama-3.1-8B-Instruct",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "Qwen/Qwen2.5-Coder-1.5B-Instruct",
)


@pytest.mark.parametrize("hub", list(MODELS))
def test_kascade_anchors_fit_or_the_start_says_how_to_calibrate(hub):
    file, layers, _, kv_heads, _ = MODELS[hub]
    name, data = _load(hub)
    reasons = parse_config(data, "kascade", name).model_reasons(layers, kv_heads)
    if hub in KASCADE_CALIBRATED:
        assert reasons == [], (file, reasons)
    else:
        assert len(reasons) == 1 and "vllm-sparse calibrate" in reasons[0], (file, reasons)
