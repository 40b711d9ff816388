"""Bad input, config level (issue 15 item 4): every field of the schema, walked from the pydantic
models so that a new field is swept too, gets a wrong type and an out-of-range value; each is
refused with a ``SparseConfigError`` naming the field, all of them at once in one error."""

from __future__ import annotations

import types
import typing

import pytest
from pydantic import BaseModel

from vllm_sparse.config import MAX_INT, SparseConfig, SparseConfigError, parse_config

LAYER = "3"  # the key under which ``layers`` (a dict of models) is swept
NO_RANGE = None  # a field whose every value of the right type is valid (bools, names)

# dotted field path -> (a value of the wrong type, a value of the right type out of range or NO_RANGE)
BAD: dict[str, tuple[object, object]] = {
    "method": (3, "sparse"),
    "budget.fraction": ("half", 1.5),
    "budget.min_tokens": (True, -1),
    "budget.max_tokens": ("16k", 0),
    "sink_tokens": ("16", -1),
    "local_tokens": (2.5, MAX_INT + 1),
    "dense_layers": ("0,1", [-1]),
    "dense_below_tokens": (False, -4096),
    "sparse_decode": ("yes", NO_RANGE),
    "sparse_prefill": (1, NO_RANGE),
    "chunk_query_window": ([64], -1),
    "dense_tail_tokens": ("64", -1),
    "executor": (1, "triton"),
    "force_sparse": ("on", NO_RANGE),
    "quoka.num_queries": (64.5, 0),
    "quest.gqa_reduce": (["max"], "mean"),
    "quest.prefill_scores": (True, "quoka"),
    "quest.decode_planes": (8, "fp8"),
    "twilight.top_p": ("0.9", 0.0),
    "twilight.candidates": (None, "kascade"),
    "twilight.candidate_fraction": (True, 1.01),
    "twilight.prune_prefill": ("no", NO_RANGE),
    "kascade.anchors": (3.5, "every_other"),
    "kascade.num_anchors": ("five", 0),
    "kascade.head_map": ([0, 1], {"2": [True, 1]}),
    "kascade.tile": (None, 0),
    "kascade.tile_stride": ("16", 0),
    "compact.block_threshold": ("low", -0.5),
    "compact.block_pages": ("8", 0),
    "compact.tile": (12.5, 0),
    "compact.query_subgroup": ([4], 0),
    f"layers.{LAYER}.budget.fraction": ([0.5], 0.0),
    f"layers.{LAYER}.budget.min_tokens": ("1k", -5),
    f"layers.{LAYER}.budget.max_tokens": (1.5, 0),
    f"layers.{LAYER}.sink_tokens": (True, -2),
    f"layers.{LAYER}.local_tokens": ("all", -3),
    f"layers.{LAYER}.dense": ("no", NO_RANGE),
    f"layers.{LAYER}.sparse_decode": ("off", NO_RANGE),
    "models": ("Qwen/Qwen3-8B", NO_RANGE),  # a list of names, not one name
}


def _model_of(annotation) -> type[BaseModel] | None:
    """The pydantic model inside ``annotation`` (``Model`` or ``Model | None``), if any."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if models else None


def schema_leaves(model: type[BaseModel] = SparseConfig, prefix: str = "") -> list[str]:
    """Every leaf field's dotted path; nested models are walked, ``dict[int, Model]`` under ``LAYER``."""
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if (sub := _model_of(field.annotation)) is not None:
            out += schema_leaves(sub, f"{path}.")
        elif typing.get_origin(field.annotation) is dict and (sub := _model_of(typing.get_args(field.annotation)[1])):
            out += schema_leaves(sub, f"{path}.{LAYER}.")
        else:
            out.append(path)
    return out


def nest(path: str, value) -> dict:
    """``"a.b.c", v`` -> ``{"a": {"b": {"c": v}}}``."""
    *parents, leaf = path.split(".")
    data = {leaf: value}
    for p in reversed(parents):
        data = {p: data}
    return data


def reasons_for(data: dict) -> list[str]:
    with pytest.raises(SparseConfigError) as e:
        parse_config(data, "quoka", "sweep")
    assert all(r in str(e.value) for r in e.value.reasons)  # every reason is in the message
    return e.value.reasons


def names(reason: str, path: str) -> bool:
    return reason.startswith(path)


def test_every_schema_field_has_bad_values():
    leaves = schema_leaves()
    assert len(leaves) >= 25, leaves  # the walk reached the nested options
    missing = [p for p in leaves if p not in BAD]
    assert not missing, f"fields with no bad values in BAD (add them): {missing}"
    stale = [p for p in BAD if p not in leaves]
    assert not stale, f"BAD names fields the schema no longer has: {stale}"


CASES = [
    (p, kind) for kind, i in (("wrong_type", 0), ("out_of_range", 1)) for p in sorted(BAD) if BAD[p][i] is not NO_RANGE
]


@pytest.mark.parametrize("path,kind", CASES)
def test_bad_value_refused_naming_the_field(path, kind):
    value = BAD[path][0 if kind == "wrong_type" else 1]
    reasons = reasons_for(nest(path, value))
    assert any(names(r, path) for r in reasons), (path, value, reasons)
    leaf = path.rsplit(".", 1)[-1]
    assert all(leaf in r for r in reasons), (path, value, reasons)  # nothing unrelated reported


@pytest.mark.parametrize("kind", [0, 1])
def test_every_bad_field_at_once_reports_every_reason(kind):
    data: dict = {}
    bad = {p: v[kind] for p, v in BAD.items() if v[kind] is not NO_RANGE and p != "method"}
    for path, value in bad.items():
        *parents, leaf = path.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    reasons = reasons_for(data)
    missing = [p for p in bad if not any(names(r, p) for r in reasons)]
    assert not missing, (missing, reasons)


@pytest.mark.parametrize(
    "data,path",
    [
        ({"sparse_budget": 0.1}, "sparse_budget"),
        ({"budget": {"fraktion": 0.1}}, "budget.fraktion"),
        ({"quoka": {"num_query": 8}}, "quoka.num_query"),
        ({"quest": {"page_size": 16}}, "quest.page_size"),
        ({"twilight": {"top_k": 8}}, "twilight.top_k"),
        ({"kascade": {"anchor": [0]}}, "kascade.anchor"),
        ({"compact": {"threshold": 0.1}}, "compact.threshold"),
        ({"layers": {"2": {"sparse": False}}}, "layers.2.sparse"),
        ({"layers": {"2": {"budget": {"fractions": 0.5}}}}, "layers.2.budget.fractions"),
    ],
)
def test_unknown_field_refused_by_name(data, path):
    reasons = reasons_for(data)
    assert reasons == [f"{path}: unknown field"], reasons


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"dense_layers": [0, True]}, "dense_layers.1 = True"),
        ({"layers": {"-1": {}}}, "layers.-1"),
        ({"kascade": {"head_map": {"-2": [0]}}}, "kascade.head_map.-2"),
        ({"kascade": {"head_map": {"2": [0, -1]}}}, "kascade.head_map.2.1 = -1"),
        ({"kascade": {"anchors": [0, -1]}}, "kascade.anchors.1 = -1"),
        ({"kascade": {"anchors": [0, "x"]}}, "kascade.anchors.1 = 'x'"),
    ],
)
def test_bad_list_items_and_keys_named_one_reason_each(data, needle):
    reasons = reasons_for(data)
    assert len(reasons) == 1 and reasons[0].startswith(needle), reasons


def test_good_values_of_the_same_fields_still_accepted():
    cfg = parse_config(
        {
            "budget": {"fraction": 1, "min_tokens": 0, "max_tokens": None},  # an int where a float goes
            "sink_tokens": 0,
            "dense_layers": [],
            "sparse_decode": False,
            "force_sparse": True,
            "chunk_query_window": 0,
            "kascade": {"anchors": "evenly_spaced", "head_map": {"2": [1, 0]}},
            "layers": {"2": {"budget": {"max_tokens": None}, "dense": True}},  # JSON keys are strings
        },
        "quoka",
        "sweep",
    )
    assert cfg.budget.fraction == 1.0 and cfg.budget.max_tokens is None
    assert cfg.kascade.head_map == {2: [1, 0]} and cfg.layers[2].dense is True
