"""``vllm-sparse calibrate``: run the dense model (transformers, eager attention, CPU or GPU) on a
calibration set, measure Kascade's layer similarity, pick anchors and head maps, write YAML + PNG.

The calibration set ships with Python itself: by default, source files of the standard library (code
and its docstrings; nothing is fetched). ``--data`` takes text files instead (the paper used MuSiQue,
which no installed package ships; calibrate on text like the served traffic where it differs).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

from vllm_sparse.calibration.anchors import objective, select_anchors
from vllm_sparse.calibration.similarity import layer_similarity, prompt_head_similarity

#: standard-library sources of the default calibration set, in this order
STDLIB_FILES = ("argparse.py", "textwrap.py", "json/decoder.py", "difflib.py", "csv.py", "fractions.py",
                "heapq.py", "string.py", "shlex.py", "calendar.py")  # fmt: skip


def default_texts() -> list[tuple[str, str]]:
    """``(name, text)`` of the default calibration set (standard-library sources)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [(f"stdlib/{f}", (lib / f).read_text(encoding="utf-8")) for f in STDLIB_FILES if (lib / f).is_file()]


def make_prompts(tokenizer, texts: list[tuple[str, str]], num_prompts: int, tokens: int) -> list[list[int]]:
    """``num_prompts`` prompts of ``tokens`` token ids, cut from the texts in order (one text may
    give several prompts; a short text is joined with the next)."""
    ids: list[int] = []
    prompts = []
    for _, text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(ids) >= tokens and len(prompts) < num_prompts:
            prompts.append(ids[:tokens])
            ids = ids[tokens:]
    if not prompts:
        raise ValueError(f"the calibration texts hold fewer than {tokens} tokens")
    return prompts


class _Recorder:
    """Forward hooks on every attention block: the pooled weights ``[Hkv, T, T]`` (fp16) and the
    block's importance ``mean_t (1 - cos(x_t, y_t))``."""

    def __init__(self, layers, num_kv_heads: int):
        self.hkv = num_kv_heads
        self.pooled: list[torch.Tensor | None] = [None] * len(layers)
        self.importance = [0.0] * len(layers)
        self.handles = [
            layer.self_attn.register_forward_hook(self._hook(i), with_kwargs=True) for i, layer in enumerate(layers)
        ]

    def _hook(self, i: int):
        def hook(module, args, kwargs, output):
            x = kwargs.get("hidden_states", args[0] if args else None)
            y, w = output[0], output[1]
            if w is None:
                raise RuntimeError("the attention block returned no weights: load the model with eager attention")
            _, hq, t, _ = w.shape
            self.pooled[i] = w[0].float().view(self.hkv, hq // self.hkv, t, t).mean(1).half()
            cos = torch.nn.functional.cosine_similarity(x[0].float(), y[0].float(), dim=-1)
            self.importance[i] = float((1 - cos).mean())

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def calibrate(model_path: str, texts: list[tuple[str, str]], num_prompts: int = 4, tokens: int = 1536,
              num_anchors: int = 5, k: int = 64, progress: bool = True) -> dict:  # fmt: skip
    """Calibrate ``model_path`` (a local folder or a name transformers resolves); returns a record
    with ``anchors``, ``head_map`` (reuse layer -> anchor KV head per KV head), ``similarity [L, L]``,
    ``weights [L]`` and what it ran on."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = model.config
    hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    layers = model.model.layers
    prompts = make_prompts(tok, texts, num_prompts, tokens)
    rec = _Recorder(layers, hkv)
    head_sum, w_sum = None, torch.zeros(len(layers))
    try:
        for ids in tqdm(prompts, desc="calibrate", unit="prompt", disable=not progress):
            with torch.no_grad():
                model(torch.tensor([ids]), use_cache=False)
            sim = prompt_head_similarity(rec.pooled, k)
            head_sum = sim if head_sum is None else head_sum + sim
            w_sum += torch.tensor(rec.importance)
    finally:
        rec.remove()
    head_sim = head_sum / len(prompts)
    weights = w_sum / len(prompts)
    s, maps = layer_similarity(head_sim, weights)
    anchors = select_anchors(s.double().numpy(), num_anchors)
    head_map = {}
    for a, b in zip(anchors, [*anchors[1:], len(layers)]):
        for layer in range(a + 1, b):
            head_map[layer] = maps[a, layer].tolist()
    return {
        "anchors": anchors,
        "head_map": head_map,
        "similarity": s.numpy(),
        "weights": weights.numpy(),
        "objective": objective(s.double().numpy(), anchors),
        "num_prompts": len(prompts),
        "tokens": tokens,
        "k": k,
        "data": [name for name, _ in texts],
    }


def kascade_yaml_block(record: dict, model: str) -> str:
    """The ``kascade:`` block of a config, with a comment saying how it was made."""
    hm = ", ".join(f"{layer}: {heads}" for layer, heads in record["head_map"].items())
    data = ", ".join(record["data"][:3]) + (", ..." if len(record["data"]) > 3 else "")
    return (
        f"# kascade: calibrated by `vllm-sparse calibrate` on {model}: {record['num_prompts']} prompts of "
        f"{record['tokens']} tokens ({data}), top-{record['k']} recovery, min over tokens, mean over prompts,\n"
        f"# layer-weighted, anchors by the paper's dynamic program; head_map: reuse layer -> anchor KV head per KV head.\n"
        f"kascade:   # our measurement: `vllm-sparse calibrate` (above)\n  anchors: {record['anchors']}\n  head_map: {{{hm}}}\n"
    )


def write_config(path: Path, block: str, models: list[str] | None = None) -> None:
    """Write ``block`` into the YAML at ``path``: replaces an existing top-level ``kascade:`` block
    (and its comment lines) and keeps the rest; a new file gets ``models`` and the block."""
    if path.is_file():
        out, skipping = [], False
        for line in path.read_text().splitlines(keepends=True):
            top = not line.startswith((" ", "\t"))
            if top and line.startswith(("kascade:", "# kascade:")):
                skipping = True
                continue
            if skipping and (not top or line.startswith("# layer-weighted")):
                continue
            skipping = False
            out.append(line)
        text = "".join(out).rstrip("\n") + "\n" + block
    else:
        text = (f"models: {models}\n" if models else "") + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def plot(record: dict, path: Path, model: str) -> None:
    """PNG of the weighted similarity matrix with the anchors marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = np.array(record["similarity"])
    n = s.shape[0]
    masked = np.where(np.triu(np.ones_like(s)) > 0, s, np.nan)
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    im = ax.imshow(masked, cmap="viridis", origin="upper")
    fig.colorbar(im, ax=ax, label="w_b * recovered top-k mass (min over tokens)")
    bounds = [*record["anchors"], n]
    for a, b in zip(bounds, bounds[1:]):
        ax.add_patch(plt.Rectangle((a - 0.5, a - 0.5), b - a, 1, fill=False, edgecolor="red", lw=1.5))
    ax.set_xlabel("layer b (served)")
    ax.set_ylabel("layer a (anchor)")
    ax.set_title(f"{Path(model).name}: anchors {record['anchors']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
