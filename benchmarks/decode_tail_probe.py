"""Which decode-page rule keeps a real model's answer: greedy answers with dense and sparse decode on one eval prompt.

The prompt of ``vllm-sparse eval`` (task, context, sample index, seed 0) is prefilled densely with transformers on
the CPU (chunks of 2048). Then each variant decodes greedily from a copy of that cache, with every decode step's
attention computed by the variant in every layer but layer 0 (the shipped configs' dense layer). So only the decode
rule differs between variants:

* ``dense``: every key.
* ``oracle``: per KV head, the sink page, the pages of the local window, and the budget's pages with the most
  softmax mass of this step's query (summed over the G query heads of the KV head). No selector does better at that
  page count.
* ``quest``: the budget's pages by Quest's bound ``sum_d max(q_d kmax_d, q_d kmin_d)``, the maximum over the group's
  heads.
* ``oracle-heads``: as ``oracle``, but each query head keeps its own pages (no page set shared by the group).
* ``...+mean``: as the rule before it, plus each dropped page attended through one pseudo-key, the page's mean key
  with the log of its token count added to its logit, and the page's mean value. The dropped pages' mass is
  estimated, not dropped.
* ``...@F``: the rule at a budget of ``F`` of the context instead of ``--budget``.
* ``...:dense=A-B,C``: the rule, but layers ``A..B`` and ``C`` decode dense too (which layers carry the loss).

``--cache FILE`` keeps the prefilled cache (about 1 GB at 32K for the 1.5B model): a later run with the same prompt
loads it instead of prefilling again (27 minutes at 32K on 2 cores).

    python benchmarks/decode_tail_probe.py --model qwen2.5-coder-1.5b-instruct --task vt --context 32768 \\
        --index 4 --out benchmarks/results/decode_tail_probe/vt32k_i4.json

Writes each variant's answer and score (``vllm_sparse.eval.tasks.score``) beside the expected answer.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

NAME = "vllm_sparse_tail_probe"


class Rule:
    """The decode attention of one variant: ``forward(query [1, Hq, 1, D], key/value [1, Hkv, S, D], scale)``."""

    def __init__(self, name: str, budget: float, page: int, sink: int, local: int, dense_layers=(0,)):
        name, _, extra = name.partition(":dense=")
        name, _, override = name.partition("@")
        budget = float(override) if override else budget
        self.name, self.budget, self.page, self.sink, self.local = name, budget, page, sink, local
        self.dense_layers = set(dense_layers) | _layer_set(extra)
        self.kept_share: list[float] = []

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float):
        q = query[0, :, 0].float()  # [Hq, D]
        k, v = key[0].float(), value[0].float()  # [Hkv, S, D]
        hkv, s, d = k.shape
        g = q.shape[0] // hkv
        qg = q.view(hkv, g, d)
        logits = torch.einsum("hgd,hsd->hgs", qg, k) * scale  # [Hkv, G, S]
        if self.name == "dense" or layer in self.dense_layers:
            out = torch.einsum("hgs,hsd->hgd", logits.softmax(-1), v)
            return out.reshape(1, 1, hkv * g, d)
        n = self.page
        full = s // n  # complete pages; the partial last page is in the local window
        forced = torch.zeros(full, dtype=torch.bool)
        forced[: -(-self.sink // n)] = True
        forced[max(0, (s - self.local) // n) :] = True
        k_pages = min(int(self.budget * s) // n, int((~forced).sum()))
        # page scores [Hkv, 1 or G, pages]: one page set per KV head, or one per query head (oracle-heads)
        if self.name.startswith("oracle"):
            w = logits.softmax(-1)[..., : full * n].reshape(hkv, g, full, n).sum(3)
            w = w if self.name.startswith("oracle-heads") else w.sum(1, keepdim=True)
        else:  # quest
            kp = k[:, : full * n].reshape(hkv, full, n, d)
            kmin, kmax = kp.amin(2), kp.amax(2)  # [Hkv, pages, D]
            w = torch.maximum(qg[:, :, None] * kmin[:, None], qg[:, :, None] * kmax[:, None]).sum(-1)
            w = w.amax(1, keepdim=True)
        w = w.masked_fill(forced, float("-inf"))
        keep = forced.expand(w.shape).clone()
        keep.scatter_(2, w.topk(k_pages, dim=-1).indices, True)
        self.kept_share.append(float(keep.any(1).float().mean()))  # pages some head of the group reads
        tail_tokens = torch.ones(*keep.shape[:2], s - full * n, dtype=torch.bool)
        tok_keep = torch.cat([keep.repeat_interleave(n, 2), tail_tokens], 2)
        masked = logits.masked_fill(~tok_keep, float("-inf"))
        if not self.name.endswith("+mean"):
            out = torch.einsum("hgs,hsd->hgd", masked.softmax(-1), v)
            return out.reshape(1, 1, hkv * g, d)
        kbar = k[:, : full * n].reshape(hkv, full, n, d).mean(2)  # [Hkv, pages, D]
        vbar = v[:, : full * n].reshape(hkv, full, n, d).mean(2)
        tail = torch.einsum("hgd,hpd->hgp", qg, kbar) * scale + math.log(n)
        tail = tail.masked_fill(keep, float("-inf"))  # kept pages are attended exactly
        p = torch.cat([masked, tail], -1).softmax(-1)
        out = torch.einsum("hgs,hsd->hgd", p[..., :s], v) + torch.einsum("hgp,hpd->hgd", p[..., s:], vbar)
        return out.reshape(1, 1, hkv * g, d)


def _layer_set(text: str) -> set[int]:
    """``"1-3,7"`` -> ``{1, 2, 3, 7}``."""
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


_RULE: list[Rule] = []


def _attention(module, query, key, value, attention_mask, **kwargs):
    """transformers ``AttentionInterface`` function: SDPA for prefill chunks, the active rule for decode steps."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] == 1 and _RULE:
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        out = _RULE[-1].forward(module.layer_idx, query, key, value, scale)
        return out.to(query.dtype), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def load(path: str, dtype: torch.dtype):
    from vllm_sparse.eval.capture import load_model

    return load_model(path, dtype, name=NAME, attention=_attention)


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    from transformers import DynamicCache

    from vllm_sparse.eval.models import resolve_model
    from vllm_sparse.eval.tasks import make_samples, score

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--task", default="vt")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--index", type=int, default=0, help="sample index of the eval's prompts (seed 0, 20 samples)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--variants", nargs="+", default=["dense", "oracle", "oracle+mean", "quest", "quest+mean"])
    ap.add_argument("--max-new", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache", type=Path, default=None, help="keep the prefilled cache here (loaded if present)")
    args = ap.parse_args(argv)
    model, tok = load(str(resolve_model(args.model)), torch.bfloat16)
    sample = make_samples(tok, args.task, args.context, args.samples)[args.index]
    ids = tok(sample.prompt, add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    if args.cache is not None and args.cache.exists():
        saved = torch.load(args.cache, weights_only=False)
        assert saved["ids"] == ids, f"{args.cache} holds another prompt"
        cache, first = saved["cache"], saved["first"]
    else:
        cache = DynamicCache(config=model.config)
        for start in range(0, len(ids), 2048):
            out = model(input_ids=torch.tensor([ids[start : start + 2048]]), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)  # fmt: skip
            print(f"prefill {start + 2048}/{len(ids)} {time.perf_counter() - t0:.0f} s", flush=True)
        first = int(out.logits[0, -1].argmax())
        if args.cache is not None:
            torch.save({"ids": ids, "cache": cache, "first": first}, args.cache)
    prefill_s = time.perf_counter() - t0
    results = []
    for name in args.variants:
        rule = Rule(name, args.budget, page=16, sink=16, local=512)
        _RULE.append(rule)
        c, token, new = copy.deepcopy(cache), first, [first]
        for _ in range(args.max_new - 1):
            o = model(input_ids=torch.tensor([[token]]), past_key_values=c, use_cache=True, logits_to_keep=1)
            token = int(o.logits[0, -1].argmax())
            if token == tok.eos_token_id:
                break
            new.append(token)
        _RULE.pop()
        text = tok.decode(new, skip_special_tokens=True)
        kept = sum(rule.kept_share) / len(rule.kept_share) if rule.kept_share else 1.0
        results.append({"variant": name, "output": text, "score": score(sample.expected, text), "kept_pages": kept})
        print(f"{name:12s} {results[-1]['score']:.2f} kept {kept:.3f} {text!r}", flush=True)
    doc = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "machine": platform.processor() or platform.machine(),
        "model": args.model, "task": args.task, "context": args.context, "index": args.index,
        "prompt_tokens": len(ids), "expected": list(sample.expected), "budget": args.budget,
        "prefill_s": prefill_s, "results": results,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
