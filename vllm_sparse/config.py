"""Selector configuration: pydantic models, YAML loading, and where the config comes from.

Sources, first match wins (DESIGN.md section 5):
  1. ``--additional-config '{"sparse_attention": {...}}'`` (inline fields, or ``{"config": PATH}``
     plus optional inline fields that override the file's);
  2. the environment variable ``SPARSE_ATTENTION_CONFIG`` (a path to a YAML file);
  3. a shipped ``vllm_sparse/configs/<model>.yaml`` matched on the model's name;
  4. the method defaults below.
The method itself comes from the backend name (``sparse_quoka`` -> ``quoka``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

METHODS = ("quoka", "quest", "twilight", "kascade", "compact")
Method = Literal["quoka", "quest", "twilight", "kascade", "compact"]
ENV_VAR = "SPARSE_ATTENTION_CONFIG"
ADDITIONAL_CONFIG_KEY = "sparse_attention"
SHIPPED_DIR = Path(__file__).parent / "configs"


class SparseConfigError(ValueError):
    """An invalid selector config; the message lists every bad field at once."""

    def __init__(self, source: str, reasons: list[str]):
        self.source = source
        self.reasons = reasons
        lines = "\n".join(f"  - {r}" for r in reasons)
        super().__init__(f"invalid sparse attention config ({source}):\n{lines}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Budget(_Strict):
    """Past-context tokens attended per (request, KV head): clamp(fraction * context, min, max)."""

    fraction: float = Field(0.125, gt=0.0, le=1.0)
    min_tokens: int = Field(1024, ge=0)
    max_tokens: int | None = Field(16384, ge=1)

    @model_validator(mode="after")
    def _min_below_max(self) -> Budget:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    def tokens(self, context_len: int) -> int:
        want = max(int(self.fraction * context_len), self.min_tokens)
        return want if self.max_tokens is None else min(want, self.max_tokens)


class QuokaOptions(_Strict):
    num_queries: int = Field(64, ge=1, description="queries kept per chunk and query head (N_Q)")


class QuestOptions(_Strict):
    gqa_reduce: Literal["max", "sum", "union"] = "max"


class TwilightOptions(_Strict):
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    candidates: Literal["quest", "quoka"] = "quest"
    candidate_fraction: float = Field(0.25, gt=0.0, le=1.0)


class KascadeOptions(_Strict):
    anchors: list[int] = Field(default_factory=lambda: [0, 2, 8, 13, 14])
    head_map: dict[str, Any] = Field(default_factory=dict)


class CompactOptions(_Strict):
    block_threshold: float = Field(0.06, gt=0.0, le=1.0)


class LayerOverride(_Strict):
    """Per-layer overrides; unset fields inherit the top-level value."""

    budget: dict[str, Any] | None = None
    sink_tokens: int | None = Field(None, ge=0)
    local_tokens: int | None = Field(None, ge=0)
    dense: bool | None = None

    @model_validator(mode="after")
    def _budget_fields_valid(self) -> LayerOverride:
        if self.budget is not None:
            Budget(**self.budget)  # raises with the field name when invalid
        return self


class SparseConfig(_Strict):
    method: Method = "quoka"
    budget: Budget = Budget()
    sink_tokens: int = Field(16, ge=0)
    local_tokens: int = Field(512, ge=0)
    dense_layers: list[int] = Field(default_factory=lambda: [0])
    dense_below_tokens: int = Field(4096, ge=0)
    quoka: QuokaOptions = QuokaOptions()
    quest: QuestOptions = QuestOptions()
    twilight: TwilightOptions = TwilightOptions()
    kascade: KascadeOptions = KascadeOptions()
    compact: CompactOptions = CompactOptions()
    layers: dict[int, LayerOverride] = Field(default_factory=dict)

    def model_reasons(self, num_layers: int) -> list[str]:
        """Reasons this config does not fit a model with ``num_layers`` attention layers."""
        reasons = []
        for idx in self.dense_layers:
            if not 0 <= idx < num_layers:
                reasons.append(f"dense_layers: {idx} is not a layer of this model (0..{num_layers - 1})")
        for idx in self.layers:
            if not 0 <= idx < num_layers:
                reasons.append(f"layers: key {idx} is not a layer of this model (0..{num_layers - 1})")
        return reasons

    @functools.cache
    def for_layer(self, layer_idx: int) -> LayerPolicy:
        """The policy of one layer, with its overrides applied."""
        o = self.layers.get(layer_idx, LayerOverride())
        budget = self.budget if o.budget is None else Budget(**{**self.budget.model_dump(), **o.budget})
        dense = layer_idx in self.dense_layers if o.dense is None else o.dense
        return LayerPolicy(
            dense=dense,
            budget=budget,
            sink_tokens=self.sink_tokens if o.sink_tokens is None else o.sink_tokens,
            local_tokens=self.local_tokens if o.local_tokens is None else o.local_tokens,
            dense_below_tokens=self.dense_below_tokens,
        )

    def __hash__(self) -> int:  # frozen model: hash by value for the cache above
        return hash(self.model_dump_json())


@dataclass(frozen=True)
class LayerPolicy:
    """What stage 1 (policy) needs to plan one layer of one step."""

    dense: bool
    budget: Budget
    sink_tokens: int
    local_tokens: int
    dense_below_tokens: int


@dataclass(frozen=True)
class ResolvedConfig:
    config: SparseConfig
    source: str


def method_of_backend(backend_name: str) -> str:
    """``SPARSE_QUOKA`` -> ``quoka``."""
    name = backend_name.lower()
    if not name.startswith("sparse_") or name[len("sparse_"):] not in METHODS:
        raise ValueError(f"{backend_name!r} is not a vllm-sparse backend name")
    return name[len("sparse_"):]


def _load_yaml(path: str | Path, source: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise SparseConfigError(source, [f"config: {str(path)!r}: file not found"])
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise SparseConfigError(source, [f"config: {str(path)!r}: not valid YAML ({e})"]) from e
    if not isinstance(data, dict):
        raise SparseConfigError(source, [f"config: {str(path)!r}: top level must be a mapping"])
    return data


def _format_errors(err: ValidationError, data: dict[str, Any]) -> list[str]:
    reasons = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        value = e.get("input")
        if e["type"] == "extra_forbidden":
            reasons.append(f"{loc}: unknown field")
        elif e["type"] == "literal_error" or isinstance(value, (int, float, str, bool, type(None))):
            reasons.append(f"{loc} = {value!r}: {e['msg']}")
        else:
            reasons.append(f"{loc}: {e['msg']}")
    return reasons


def parse_config(data: dict[str, Any], method: str, source: str) -> SparseConfig:
    """Validate a raw mapping for ``method``; every invalid field is reported at once."""
    data = dict(data)
    reasons = []
    if "method" in data and data["method"] != method:
        reasons.append(
            f"method = {data['method']!r}: does not match the backend sparse_{method} "
            f"(the method comes from --attention-backend; drop the field or make them agree)"
        )
        data.pop("method")
    try:
        cfg = SparseConfig(**{**data, "method": method})
    except ValidationError as e:
        reasons += _format_errors(e, data)
        cfg = None
    if reasons:
        raise SparseConfigError(source, reasons)
    assert cfg is not None
    return cfg


def shipped_config_path(model: str | None) -> Path | None:
    """The shipped YAML whose stem equals the model name's last path component (case-insensitive)."""
    if not model:
        return None
    stem = Path(str(model).rstrip("/")).name.lower()
    for p in sorted(SHIPPED_DIR.glob("*.yaml")):
        if p.stem.lower() == stem:
            return p
    return None


def resolve_config(
    method: str,
    model: str | None = None,
    additional_config: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> ResolvedConfig:
    """Find, load and validate the selector config for ``method`` and ``model``."""
    environ = os.environ if environ is None else environ
    extra = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if extra is not None:
        source = f"--additional-config {ADDITIONAL_CONFIG_KEY}"
        if not isinstance(extra, dict):
            raise SparseConfigError(source, [f"{ADDITIONAL_CONFIG_KEY} = {extra!r}: must be a mapping"])
        inline = dict(extra)
        path = inline.pop("config", None)
        data = {}
        if path is not None:
            source += f" (config {path})"
            data = _load_yaml(path, source)
        return ResolvedConfig(parse_config(_deep_merge(data, inline), method, source), source)
    if environ.get(ENV_VAR):
        source = f"${ENV_VAR}={environ[ENV_VAR]}"
        return ResolvedConfig(parse_config(_load_yaml(environ[ENV_VAR], source), method, source), source)
    shipped = shipped_config_path(model)
    if shipped is not None:
        source = f"shipped {shipped.name}"
        return ResolvedConfig(parse_config(_load_yaml(shipped, source), method, source), source)
    return ResolvedConfig(parse_config({}, method, "defaults"), "defaults")


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
