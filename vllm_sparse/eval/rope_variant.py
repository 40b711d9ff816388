"""A model served past its trained window by YaRN RoPE scaling: ``NAME@yarnF``.

``qwen2.5-coder-1.5b-instruct@yarn4`` (or ``/path/to/folder@yarn4``) names the model with YaRN
scaling by ``F`` on top of its RoPE: a folder beside the converted model whose ``config.json`` sets
``rope_parameters = {rope_type: yarn, factor: F, original_max_position_embeddings: M}`` and
``max_position_embeddings = F * M`` (the form transformers' ``_compute_yarn_parameters`` and vLLM's
max-length check both read), every other file a link to the base model's. This is how Qwen2.5
documents serving its models past 32K (``rope_scaling: {type: yarn, factor: 4.0,
original_max_position_embeddings: 32768}``); for the 0.5B and 1.5B Qwen2.5-Coder models Qwen states
32K only, so answers past 32K measure the scaled model as it is, dense and sparse alike, and the
sparse methods are judged against dense on the same scaled model.

The folder is ``<cache>/models/rope/yarn<F>-<hash of the base folder>/<base folder's name>``: the last
path component stays the model's own, so its shipped selector config still matches
(``config.match_shipped_config``). It is built once, under a lock, and marked complete last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from vllm_sparse.eval.models import cache_root, file_lock

SUFFIX = "@yarn"
MARKER_FILE = ".vllm_sparse_rope.json"


def split_rope_suffix(name: str) -> tuple[str, float | None]:
    """``"m@yarn4"`` -> ``("m", 4.0)``; a name without the suffix -> ``(name, None)``.

    Raises:
        ValueError: the suffix holds no number above 1.
    """
    base, sep, factor = str(name).rpartition(SUFFIX)
    if not sep:
        return str(name), None
    try:
        value = float(factor)
    except ValueError:
        raise ValueError(
            f"{name!r}: expected NAME{SUFFIX}FACTOR with a number, e.g. {base or 'model'}{SUFFIX}4"
        ) from None
    if not value > 1.0 or not base:
        raise ValueError(f"{name!r}: the YaRN factor must be above 1 and follow a model name (e.g. {SUFFIX}4)")
    return base, value


def _scaled_config(config: dict, factor: float, source: Path) -> tuple[dict, int, int]:
    """``config`` with YaRN by ``factor``: (new config, original window, new window)."""
    original = config.get("max_position_embeddings")
    if not isinstance(original, int) or original <= 0:
        raise ValueError(f"{source}: no usable max_position_embeddings to scale")
    rope = config.get("rope_parameters")
    legacy = config.get("rope_scaling")
    current = (rope or {}).get("rope_type") or (legacy or {}).get("rope_type") or (legacy or {}).get("type")
    if current not in (None, "default"):
        raise ValueError(f"{source}: the model already scales RoPE ({current!r}); not scaling it again")
    window = int(round(original * factor))
    yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    out = dict(config, max_position_embeddings=window)
    if rope is not None or "rope_theta" not in config:  # transformers 5 keeps rope_theta inside rope_parameters
        out["rope_parameters"] = {**(rope or {}), **yarn}
        out.pop("rope_scaling", None)
    else:  # a transformers 4 config: rope_theta at the top, scaling in rope_scaling
        out["rope_scaling"] = {"type": "yarn", **yarn}
    return out, original, window


def yarn_folder(base: str | os.PathLike[str], factor: float) -> Path:
    """The YaRN-scaled twin of the model folder ``base`` (built on first use; see the module docstring).

    Raises:
        ValueError: ``factor`` is not above 1, or ``base`` has no usable window or already scales RoPE.
    """
    if not factor > 1.0:
        raise ValueError(f"YaRN factor {factor} must be above 1")
    base = Path(base).resolve()
    digest = hashlib.sha256(str(base).encode()).hexdigest()[:10]
    target = cache_root() / "rope" / f"yarn{factor:g}-{digest}" / base.name
    if (target / MARKER_FILE).is_file():
        return target
    config, original, window = _scaled_config(json.loads((base / "config.json").read_text()), factor, base)
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / ".lock"):
        if (target / MARKER_FILE).is_file():  # another process built it meanwhile
            return target
        work = target.parent / f".{base.name}.work"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        for item in base.iterdir():
            if item.name in ("config.json", "tokenizer_config.json") or item.name.startswith("."):
                continue
            (work / item.name).symlink_to(item.resolve())
        (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tok_cfg = base / "tokenizer_config.json"
        if tok_cfg.is_file():
            tok = json.loads(tok_cfg.read_text())
            if isinstance(tok.get("model_max_length"), int):
                tok["model_max_length"] = window
            (work / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")
        marker = {"base": str(base), "rope_type": "yarn", "factor": factor,
                  "original_max_position_embeddings": original, "max_position_embeddings": window}  # fmt: skip
        (work / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        shutil.rmtree(target, ignore_errors=True)  # a stale folder without the marker
        os.replace(work, target)
    return target
