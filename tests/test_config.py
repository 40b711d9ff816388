"""Stage 0 (configuration): vllm_sparse/config.py."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError

from vllm_sparse import config as cfgmod
from vllm_sparse.config import (
    ENV_VAR,
    METHODS,
    Budget,
    LayerPolicy,
    SparseConfig,
    SparseConfigError,
    method_of_backend,
    parse_config,
    resolve_config,
    shipped_config_path,
)

QWEN = "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def write_yaml(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def reasons_of(excinfo) -> list[str]:
    return excinfo.value.reasons


def has_reason(reasons: list[str], *needles: str) -> bool:
    return any(all(n in r for n in needles) for r in reasons)


# --------------------------------------------------------------------------------------------
# defaults
# --------------------------------------------------------------------------------------------


def test_defaults_match_design():
    c = SparseConfig()
    assert c.method == "quoka"
    assert (c.budget.fraction, c.budget.min_tokens, c.budget.max_tokens) == (0.125, 1024, 16384)
    assert c.sink_tokens == 16
    assert c.local_tokens == 512
    assert c.dense_layers == [0]
    assert c.dense_below_tokens == 4096
    assert c.quoka.num_queries == 64
    assert c.quest.gqa_reduce == "max"
    assert (c.twilight.top_p, c.twilight.candidates, c.twilight.candidate_fraction) == (0.95, "quest", 0.25)
    assert c.kascade.anchors is None  # calibrated per model (shipped configs), else a start-up error
    assert c.kascade.head_map == {}
    assert c.compact.block_threshold == 0.06
    assert c.layers == {}


@pytest.mark.parametrize("method", METHODS)
def test_resolve_defaults(method, monkeypatch, tmp_path):
    monkeypatch.setattr(cfgmod, "SHIPPED_DIR", tmp_path)  # nothing shipped
    r = resolve_config(method, model="some/unknown-model", additional_config=None, environ={})
    assert r.source.startswith("defaults")
    assert r.config == SparseConfig(method=method)


def test_default_factories_not_shared():
    a, b = SparseConfig(), SparseConfig()
    assert a.dense_layers is not b.dense_layers
    assert a.kascade.head_map is not b.kascade.head_map


def test_frozen():
    c = SparseConfig()
    with pytest.raises(ValidationError):
        c.sink_tokens = 3  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Budget.tokens
# --------------------------------------------------------------------------------------------


def budget_tokens_brute(fraction, lo, hi, ctx):
    want = int(fraction * ctx)  # floor for ctx >= 0
    want = max(want, lo)
    if hi is not None:
        want = min(want, hi)
    return want


@pytest.mark.parametrize("fraction", [0.01, 0.125, 0.5, 1.0])
@pytest.mark.parametrize("lo,hi", [(0, None), (1024, 16384), (64, 64), (100, 5000), (0, 1)])
@pytest.mark.parametrize("ctx", [0, 1, 15, 1000, 4096, 100_000, 10**7])
def test_budget_tokens_clamps(fraction, lo, hi, ctx):
    b = Budget(fraction=fraction, min_tokens=lo, max_tokens=hi)
    got = b.tokens(ctx)
    assert got == budget_tokens_brute(fraction, lo, hi, ctx)
    assert got >= min(lo, hi if hi is not None else lo)
    if hi is not None:
        assert got <= hi
    assert got >= lo or (hi is not None and got == hi)


@pytest.mark.parametrize(
    "field,value",
    [("fraction", 0.0), ("fraction", -0.1), ("fraction", 1.0001), ("min_tokens", -1), ("max_tokens", 0)],
)
def test_budget_field_bounds(field, value):
    with pytest.raises(ValidationError):
        Budget(**{field: value})


def test_budget_min_above_max_rejected():
    with pytest.raises(ValidationError, match="min_tokens"):
        Budget(min_tokens=100, max_tokens=99)
    assert Budget(min_tokens=99, max_tokens=99).tokens(10**6) == 99
    assert Budget(min_tokens=10**9, max_tokens=None).tokens(0) == 10**9


# --------------------------------------------------------------------------------------------
# method_of_backend
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("spell", [str.upper, str.lower, lambda s: s[:1].upper() + s[1:]])
def test_method_of_backend(method, spell):
    assert method_of_backend(spell(f"sparse_{method}")) == method


@pytest.mark.parametrize(
    "name", ["FLASH_ATTN", "sparse_", "sparse_dense", "quoka", "sparse-quoka", "xsparse_quoka", "sparse_quoka_x", ""]
)
def test_method_of_backend_rejects(name):
    with pytest.raises(ValueError):
        method_of_backend(name)


# --------------------------------------------------------------------------------------------
# YAML loading and source precedence
# --------------------------------------------------------------------------------------------

FILE_CFG = {
    "budget": {"fraction": 0.25, "min_tokens": 256, "max_tokens": 8192},
    "sink_tokens": 32,
    "local_tokens": 128,
    "dense_layers": [0, 1],
    "quoka": {"num_queries": 16},
    "layers": {"3": {"budget": {"fraction": 0.5}}},
}


def test_yaml_file_loaded_fully(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", FILE_CFG)
    r = resolve_config("quoka", additional_config={"sparse_attention": {"config": path}}, environ={})
    c = r.config
    assert c.budget == Budget(fraction=0.25, min_tokens=256, max_tokens=8192)
    assert (c.sink_tokens, c.local_tokens, c.dense_layers, c.quoka.num_queries) == (32, 128, [0, 1], 16)
    assert set(c.layers) == {3}  # YAML string keys become layer ints
    assert c.for_layer(3).budget == Budget(fraction=0.5, min_tokens=256, max_tokens=8192)
    assert path in r.source


def test_empty_yaml_is_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    r = resolve_config("quoka", environ={ENV_VAR: str(p)})
    assert r.config == SparseConfig()


@pytest.mark.parametrize(
    "text,needle", [("- 1\n- 2\n", "mapping"), ("budget: {fraction: [\n", "YAML"), (None, "not found")]
)
def test_bad_yaml_files(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    if text is not None:
        p.write_text(text)
    with pytest.raises(SparseConfigError) as e:
        resolve_config("quoka", environ={ENV_VAR: str(p)})
    assert has_reason(reasons_of(e), needle)
    assert ENV_VAR in str(e.value)


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """One distinct sink_tokens value per source so the winner is visible."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    write_yaml(shipped / "My-Model-7B.yaml", {"sink_tokens": 4, "local_tokens": 40})
    monkeypatch.setattr(cfgmod, "SHIPPED_DIR", shipped)
    env_path = write_yaml(tmp_path / "env.yaml", {"sink_tokens": 3, "local_tokens": 30})
    file_path = write_yaml(tmp_path / "file.yaml", {"sink_tokens": 2, "local_tokens": 20, "quoka": {"num_queries": 8}})
    return {"env": {ENV_VAR: env_path}, "file": file_path}


@pytest.mark.parametrize("use_additional", ["none", "inline", "file", "file+inline", "other_key"])
@pytest.mark.parametrize("use_env", [False, True])
@pytest.mark.parametrize("model", [None, "org/my-model-7b", "/models/MY-MODEL-7B/", "org/other"])
def test_source_precedence(sources, use_additional, use_env, model):
    additional = {
        "none": None,
        "inline": {"sparse_attention": {"sink_tokens": 1}},
        "file": {"sparse_attention": {"config": sources["file"]}},
        "file+inline": {"sparse_attention": {"config": sources["file"], "sink_tokens": 1, "quoka": {"num_queries": 9}}},
        "other_key": {"something_else": {"sink_tokens": 99}},
    }[use_additional]
    environ = sources["env"] if use_env else {}
    r = resolve_config("quoka", model=model, additional_config=additional, environ=environ)
    c = r.config
    shipped_match = model is not None and "other" not in model
    if use_additional == "inline":
        expect = (1, SparseConfig().local_tokens, 64)
    elif use_additional == "file":
        expect = (2, 20, 8)
    elif use_additional == "file+inline":  # inline overrides the file, deep-merged (local_tokens kept)
        expect = (1, 20, 9)
    elif use_env:
        expect = (3, 30, 64)
    elif shipped_match:
        expect = (4, 40, 64)
    else:
        expect = (SparseConfig().sink_tokens, SparseConfig().local_tokens, 64)
    assert (c.sink_tokens, c.local_tokens, c.quoka.num_queries) == expect
    if expect[0] == 4:
        assert "My-Model-7B.yaml" in r.source
    if expect[0] == 3:
        assert ENV_VAR in r.source


def test_env_var_empty_string_ignored(sources):
    r = resolve_config("quoka", model="org/my-model-7b", environ={ENV_VAR: ""})
    assert r.config.sink_tokens == 4


def test_env_var_read_from_os_environ(sources, monkeypatch):
    monkeypatch.setenv(ENV_VAR, sources["env"][ENV_VAR])
    assert resolve_config("quoka").config.sink_tokens == 3


def test_inline_deep_merge_keeps_file_subfields(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"budget": {"fraction": 0.25, "min_tokens": 256, "max_tokens": 8192}})
    extra = {"sparse_attention": {"config": path, "budget": {"max_tokens": 4096}}}
    c = resolve_config("quoka", additional_config=extra, environ={}).config
    assert c.budget == Budget(fraction=0.25, min_tokens=256, max_tokens=4096)


def test_a_methods_block_is_what_one_method_runs_with(tmp_path):
    """``methods: {quest: {...}}``: Quest runs the block over the rest of the file, the other methods the rest;
    inline fields win over the file's block as over the rest of the file, and an inline block wins over both."""
    path = write_yaml(tmp_path / "c.yaml", {"budget": {"fraction": 0.25, "min_tokens": 1024}, "sink_tokens": 32,
                                            "methods": {"quest": {"budget": {"min_tokens": 4096}, "sink_tokens": 64},
                                                        "twilight": {"twilight": {"top_p": 0.98}}}})  # fmt: skip

    def resolved(method, **inline):
        return resolve_config(method, additional_config={"sparse_attention": {"config": path, **inline}}).config

    quest, quoka, twilight = resolved("quest"), resolved("quoka"), resolved("twilight")
    assert (quest.budget.min_tokens, quest.budget.fraction, quest.sink_tokens) == (4096, 0.25, 64)
    assert (quoka.budget.min_tokens, quoka.sink_tokens, quoka.twilight.top_p) == (1024, 32, 0.95)
    assert (twilight.budget.min_tokens, twilight.twilight.top_p) == (1024, 0.98)
    assert quest.for_layer(3).budget.tokens(8192) == 4096 and quoka.for_layer(3).budget.tokens(8192) == 2048
    assert resolved("quest", budget={"min_tokens": 512}).budget.min_tokens == 512  # inline over the file's block
    inline_block = {"quest": {"budget": {"min_tokens": 2048}}}
    assert resolved("quest", budget={"min_tokens": 512}, methods=inline_block).budget.min_tokens == 2048
    assert resolved("quoka", methods=inline_block).budget.min_tokens == 1024
    # the same without a file
    assert parse_config({"methods": {"quest": {"budget": {"fraction": 0.5}}}}, "quest", "t").budget.fraction == 0.5


def test_bad_methods_blocks_are_reported_at_start_whichever_method_runs():
    data = {"sink_tokens": -1, "methods": {"quest": {"budget": {"fraction": 2}}, "twilight": {"twilight": {"top_p": 7}},
                                           "nope": {}, "quoka": 3, "kascade": {"method": "kascade"},
                                           "compact": {"budget": {"min_tokens": 20000}}}}  # fmt: skip
    for method in ("quest", "quoka"):
        with pytest.raises(SparseConfigError) as e:
            parse_config(data, method, "t")
        reasons = reasons_of(e)
        assert reasons[0].startswith("sink_tokens = -1") and sum("sink_tokens" in r for r in reasons) == 1
        assert has_reason(reasons, "methods.quest: budget.fraction = 2")
        assert has_reason(reasons, "methods.twilight: twilight.top_p = 7")
        assert has_reason(reasons, "methods.nope: unknown method")
        assert has_reason(reasons, "methods.quoka = 3: must be a mapping")
        assert has_reason(reasons, "methods.kascade: method cannot be set per method")
        assert has_reason(reasons, "methods.compact: budget: min_tokens (20000) must not exceed")
        assert len(reasons) == 7, reasons  # each once, and no raw pydantic dump beside the budget order
    with pytest.raises(SparseConfigError, match="must map method names"):
        parse_config({"methods": ["quest"]}, "quest", "t")


def test_additional_config_not_a_mapping():
    with pytest.raises(SparseConfigError) as e:
        resolve_config("quoka", additional_config={"sparse_attention": "budget=3"}, environ={})
    assert has_reason(reasons_of(e), "sparse_attention", "mapping")


def test_additional_config_from_json_string_roundtrip(tmp_path):
    # what vLLM hands over after parsing --additional-config JSON
    extra = json.loads('{"sparse_attention": {"budget": {"fraction": 0.0625}, "dense_layers": [0, 5]}}')
    c = resolve_config("quoka", additional_config=extra, environ={}).config
    assert c.budget.fraction == 0.0625 and c.dense_layers == [0, 5]


@pytest.mark.parametrize(
    "model,found",
    [
        (QWEN, True),
        ("qwen2.5-coder-0.5b-instruct", True),
        ("QWEN2.5-CODER-0.5B-INSTRUCT", True),
        ("/data/models/Qwen2.5-Coder-0.5B-Instruct/", True),
        ("Qwen/Qwen2.5-Coder-0.5B", False),
        ("Qwen2.5-Coder-0.5B-Instruct/extra", False),
        (None, False),
        ("", False),
    ],
)
def test_shipped_config_matching(model, found):
    p = shipped_config_path(model)
    assert (p is not None) == found
    if found:
        assert p.name == "qwen2.5-coder-0.5b-instruct.yaml"


def test_shipped_configs_are_valid_for_every_method():
    for p in sorted(cfgmod.SHIPPED_DIR.glob("*.yaml")):
        for m in METHODS:
            r = resolve_config(m, model=f"org/{p.stem}", environ={})
            assert r.source.startswith(f"shipped {p.name} (")
            assert r.config.method == m


# --------------------------------------------------------------------------------------------
# Errors: every invalid field at once, with field, value and reason
# --------------------------------------------------------------------------------------------


def test_all_errors_reported_at_once():
    bad = {
        "method": "quest",
        "budget": {"fraction": 1.5},
        "sink_tokens": -1,
        "not_a_field": 3,
        "quoka": {"num_queries": 0},
        "layers": {"2": {"budget": {"min_tokens": 9000, "max_tokens": 100}}},
    }
    with pytest.raises(SparseConfigError) as e:
        parse_config(bad, "quoka", "unit-test")
    r = reasons_of(e)
    assert has_reason(r, "method", "'quest'", "sparse_quoka")
    assert has_reason(r, "budget.fraction", "1.5")
    assert has_reason(r, "sink_tokens", "-1")
    assert has_reason(r, "not_a_field", "unknown")
    assert has_reason(r, "quoka.num_queries", "0")
    assert has_reason(r, "layers.2", "min_tokens", "9000", "100")
    assert len(r) == 6
    assert "unit-test" in str(e.value)
    for reason in r:  # every reason is a line of the message
        assert reason in str(e.value)


def test_all_errors_reported_at_once_via_resolve(tmp_path):
    path = write_yaml(
        tmp_path / "bad.yaml",
        {
            "budget": {"min_tokens": 4096, "max_tokens": 1024},
            "sink_tokens": -1,
            "extra": {},
            "quoka": {"num_queries": 0},
        },
    )
    with pytest.raises(SparseConfigError) as e:
        resolve_config(
            "quoka", additional_config={"sparse_attention": {"config": path, "local_tokens": -5}}, environ={}
        )
    r = reasons_of(e)
    assert has_reason(r, "budget", "min_tokens (4096)", "max_tokens (1024)")
    assert has_reason(r, "sink_tokens", "-1")
    assert has_reason(r, "local_tokens", "-5")
    assert has_reason(r, "extra", "unknown")
    assert has_reason(r, "quoka.num_queries", "0")
    assert len(r) == 5
    assert path in str(e.value)


def test_min_above_max_reported_beside_bad_fraction_in_same_budget():
    with pytest.raises(SparseConfigError) as e:
        parse_config({"budget": {"fraction": 1.5, "min_tokens": 4096, "max_tokens": 1024}}, "quoka", "t")
    r = reasons_of(e)
    assert has_reason(r, "budget.fraction", "1.5")
    assert has_reason(r, "min_tokens", "4096")


@pytest.mark.parametrize(
    "data,field,value",
    [
        ({"budget": {"fraction": 0}}, "budget.fraction", "0"),
        ({"budget": {"min_tokens": -3}}, "budget.min_tokens", "-3"),
        ({"budget": {"max_tokens": 0}}, "budget.max_tokens", "0"),
        ({"local_tokens": -1}, "local_tokens", "-1"),
        ({"dense_below_tokens": -1}, "dense_below_tokens", "-1"),
        ({"quest": {"gqa_reduce": "mean"}}, "quest.gqa_reduce", "'mean'"),
        ({"twilight": {"top_p": 1.5}}, "twilight.top_p", "1.5"),
        ({"twilight": {"candidates": "kascade"}}, "twilight.candidates", "'kascade'"),
        ({"compact": {"block_threshold": -0.1}}, "compact.block_threshold", "-0.1"),
        ({"quoka": {"num_queries": -4, "oops": 1}}, "quoka.num_queries", "-4"),
        ({"layers": {"1": {"sink_tokens": -7}}}, "layers.1.sink_tokens", "-7"),
        ({"layers": {"1": {"bogus": True}}}, "layers.1.bogus", "unknown"),
        ({"layers": {"one": {}}}, "layers", "'one'"),
        ({"sink_tokens": "many"}, "sink_tokens", "'many'"),
    ],
)
def test_single_error_names_field_and_value(data, field, value):
    with pytest.raises(SparseConfigError) as e:
        parse_config(data, "quoka", "t")
    assert has_reason(reasons_of(e), field, value), reasons_of(e)


def test_layer_budget_error_path_includes_budget():
    with pytest.raises(SparseConfigError) as e:
        parse_config({"layers": {"3": {"budget": {"fraction": 1.5}}}}, "quoka", "t")
    assert has_reason(reasons_of(e), "layers.3.budget.fraction", "1.5"), reasons_of(e)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("given", METHODS)
def test_method_field_must_match_backend(method, given):
    if method == given:
        assert parse_config({"method": given}, method, "t").method == method
    else:
        with pytest.raises(SparseConfigError) as e:
            parse_config({"method": given}, method, "t")
        assert has_reason(reasons_of(e), "method", repr(given), f"sparse_{method}")


def test_method_mismatch_from_file(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"method": "quest"})
    with pytest.raises(SparseConfigError) as e:
        resolve_config("quoka", environ={ENV_VAR: path})
    assert has_reason(reasons_of(e), "method", "sparse_quoka")


# --------------------------------------------------------------------------------------------
# Per-layer policy
# --------------------------------------------------------------------------------------------


def test_for_layer_defaults():
    c = SparseConfig()  # QuoKA: decode steps dense by default
    assert c.for_layer(0) == LayerPolicy(True, c.budget, 16, 512, 4096, sparse_decode=False)
    assert c.for_layer(1) == LayerPolicy(False, c.budget, 16, 512, 4096, sparse_decode=False)


@pytest.mark.parametrize("method,given,want", [("quoka", None, False), ("quest", None, True),
                                               ("twilight", None, True), ("quoka", True, True), ("quest", False, False)])
def test_sparse_decode_defaults_per_method(method, given, want):
    c = SparseConfig(method=method, sparse_decode=given)
    assert c.for_layer(1).sparse_decode is want


def test_a_layer_may_decode_dense_or_sparse_apart_from_the_rest():
    c = SparseConfig(method="quest", layers={7: {"sparse_decode": False}})
    seven, eight = c.for_layer(7), c.for_layer(8)
    assert (seven.sparse_decode, seven.decode_by_cost, seven.dense) == (False, False, False)  # prefill stays sparse
    assert (eight.sparse_decode, eight.decode_by_cost) == (True, True)  # the method's default, decided by cost
    assert not c.asks_sparse_decode() and c.may_decode_sparse()
    quoka = SparseConfig(method="quoka", sparse_decode=False, layers={3: {"sparse_decode": True}})
    assert quoka.for_layer(3).sparse_decode and not quoka.for_layer(4).sparse_decode
    assert quoka.asks_sparse_decode() and quoka.may_decode_sparse()
    assert not SparseConfig(method="quest", sparse_decode=False).may_decode_sparse()


@pytest.mark.parametrize(
    "override,expect_budget",
    [
        ({"fraction": 0.5}, (0.5, 256, 8192)),
        ({"min_tokens": 0}, (0.25, 0, 8192)),
        ({"max_tokens": None}, (0.25, 256, None)),
        ({"max_tokens": 3000, "fraction": 1.0}, (1.0, 256, 3000)),
        ({}, (0.25, 256, 8192)),
    ],
)
def test_for_layer_budget_partial_merge(override, expect_budget):
    c = parse_config(
        {"budget": {"fraction": 0.25, "min_tokens": 256, "max_tokens": 8192}, "layers": {"5": {"budget": override}}},
        "quoka",
        "t",
    )
    b = c.for_layer(5).budget
    assert (b.fraction, b.min_tokens, b.max_tokens) == expect_budget
    assert c.for_layer(4).budget == Budget(fraction=0.25, min_tokens=256, max_tokens=8192)


@pytest.mark.parametrize("layer", range(6))
def test_for_layer_dense_and_overrides(layer):
    c = parse_config(
        {
            "dense_layers": [0, 2],
            "sink_tokens": 8,
            "local_tokens": 64,
            "dense_below_tokens": 100,
            "layers": {
                "2": {"dense": False},  # dense override beats dense_layers
                "3": {"dense": True},
                "4": {"sink_tokens": 0, "local_tokens": 1000},
            },
        },
        "quoka",
        "t",
    )
    p = c.for_layer(layer)
    assert p.dense == (layer in (0, 3))
    assert p.sink_tokens == (0 if layer == 4 else 8)
    assert p.local_tokens == (1000 if layer == 4 else 64)
    assert p.dense_below_tokens == 100
    assert p.budget == c.budget


def test_for_layer_cached_and_equal_configs_agree():
    a = SparseConfig(sink_tokens=3)
    b = SparseConfig(sink_tokens=3)
    assert a.for_layer(7) is a.for_layer(7)
    assert a.for_layer(7) == b.for_layer(7)
    assert SparseConfig(sink_tokens=4).for_layer(7).sink_tokens == 4


def test_layer_budget_validated_after_merge_rejects():
    data = {"budget": {"min_tokens": 100, "max_tokens": 512}, "layers": {"3": {"budget": {"min_tokens": 2048}}}}
    with pytest.raises(SparseConfigError):
        parse_config(data, "quoka", "t")


@pytest.mark.parametrize(
    "top,override",
    [
        ({"min_tokens": 20000, "max_tokens": None}, {"min_tokens": 30000}),
        ({"min_tokens": 256, "max_tokens": 8192}, {"max_tokens": 300}),  # default min 1024 > 300
    ],
)
def test_layer_budget_validated_after_merge_accepts(top, override):
    c = parse_config({"budget": top, "layers": {"3": {"budget": override}}}, "quoka", "t")
    assert c.for_layer(3).budget == Budget(**{**top, **override})


# --------------------------------------------------------------------------------------------
# model_reasons
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [1, 4, 24])
def test_model_reasons(num_layers):
    # (negative layers are refused when parsing: tests/test_config_sweep.py)
    dense = [0, num_layers - 1, num_layers, 100]
    layers = {str(i): {"sink_tokens": 0} for i in (0, num_layers - 1, num_layers, num_layers + 5)}
    c = parse_config({"dense_layers": dense, "layers": layers}, "quoka", "t")
    r = c.model_reasons(num_layers)
    bad_dense = sorted({num_layers, 100})
    bad_keys = [num_layers, num_layers + 5]
    assert len(r) == len(bad_dense) + len(bad_keys)
    for i in bad_dense:
        assert has_reason(r, "dense_layers", str(i), f"0..{num_layers - 1}")
    for i in bad_keys:
        assert has_reason(r, "layers", str(i), f"0..{num_layers - 1}")
    assert SparseConfig().model_reasons(num_layers) == []
