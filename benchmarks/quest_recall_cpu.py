"""Recall of the dense attention mass by sparse_quest (each GQA rule) and sparse_twilight, on real
attention data: post-RoPE queries and keys of Qwen2.5-Coder-0.5B-Instruct (14 query heads, 2 KV
heads, G = 7, d = 64) over an English/Markdown text, captured with transformers on the CPU.

For every layer but 0 (dense in the default config), every KV head and every query head of its
group, dense softmax attention over all visible keys is computed exactly; recall = the share of it
that falls on the attended pages (forced sink/local/chunk pages + selected pages), averaged over
query heads, queries and layers. Two settings: one decode query (the last token) and a prefill
chunk of 64 queries at the end of the text (scores max over the chunk).

    python benchmarks/quest_recall_cpu.py [--tokens 2048] [--out benchmarks/results/quest_recall_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from vllm_sparse.metadata.int4_shadow import dequantize_int4, quantize_int4
from vllm_sparse.selectors.quest import page_upper_bounds, reduce_and_pick
from vllm_sparse.selectors.twilight import estimate_page_mass, top_p_keep

MODEL = Path.home() / ".cache/vllm-sparse/models/qwen2.5-coder-0.5b-instruct"
TEXT = Path("/work/shared/reference/seeds-digest.md")
N, SINK, LOCAL = 16, 16, 64


def capture(tokens: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.qwen2 import modeling_qwen2

    tok = AutoTokenizer.from_pretrained(MODEL)
    ids = tok(TEXT.read_text(), return_tensors="pt").input_ids[:, :tokens]
    model = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32, attn_implementation="sdpa")
    seen = []
    orig = modeling_qwen2.apply_rotary_pos_emb

    def spy(q, k, cos, sin, *a, **kw):
        q2, k2 = orig(q, k, cos, sin, *a, **kw)
        seen.append((q2[0].transpose(0, 1).clone(), k2[0].transpose(0, 1).clone()))  # [T, H, D]
        return q2, k2

    modeling_qwen2.apply_rotary_pos_emb = spy
    with torch.no_grad():
        model.model(ids[:, :tokens])
    modeling_qwen2.apply_rotary_pos_emb = orig
    return seen, ids.shape[1]


def dense_page_mass(q, k, ctx, scale):
    """q ``[C, Hq, D]`` at positions ctx..ctx+C-1, k ``[S, Hkv, D]`` -> true mass per past page
    ``[Hkv, G, P]`` (mean over queries) and the mass on the chunk's own tokens ``[Hkv, G]``."""
    c, hq, d = q.shape
    s, hkv, _ = k.shape
    g = hq // hkv
    qpos = torch.arange(ctx, ctx + c)[:, None]
    mask = torch.arange(s)[None, :] <= qpos  # [C, S]
    logits = torch.einsum("chd,shd->hcs", q.view(c, hkv, g, d).reshape(c, hq, d), k.repeat_interleave(g, dim=1))
    w = torch.softmax((logits * scale).masked_fill(~mask, float("-inf")), dim=-1).mean(dim=1)  # [Hq, S]
    p = ctx // N
    past = w[:, : p * N].view(hkv, g, p, N).sum(-1)
    return past, w[:, p * N :].sum(-1).view(hkv, g)


def evaluate(seen, total, chunk, fractions, top_ps):
    res: dict[str, list[float]] = {}
    budgets: dict[str, list[float]] = {}
    for layer, (q_all, k_all) in enumerate(seen):
        if layer == 0:
            continue
        ctx = total - chunk
        q, k = q_all[ctx:total], k_all[:total]
        d = q.shape[-1]
        scale = d**-0.5
        mass, chunk_mass = dense_page_mass(q, k, ctx, scale)  # [Hkv, G, P]
        hkv, g, p = mass.shape
        forced = sorted(set(range(math.ceil(SINK / N))) | set(range(max(0, (ctx - LOCAL) // N), p)))
        forced_t = torch.tensor(forced)
        free = p - len(forced)
        keys = k[: p * N].view(p, N, hkv, d)
        kmin, kmax = keys.amin(1).transpose(0, 1), keys.amax(1).transpose(0, 1)  # [Hkv, P, D]
        bounds = page_upper_bounds(q, kmin, kmax)
        base = mass[:, :, forced].sum(-1) + chunk_mass  # [Hkv, G]

        def recall(picked, mass=mass, base=base):  # picked [Hkv, k] -> mean recall over query heads
            got = torch.stack([mass[h][:, picked[h]].sum(-1) for h in range(mass.shape[0])])
            return float((base + got).mean())

        for f in fractions:
            kpages = min(free, max(0, math.ceil(f * ctx / N) - len(forced)))
            for rule in ("max", "sum", "union"):
                res.setdefault(f"quest_{rule}@{f}", []).append(recall(reduce_and_pick(bounds, forced_t, kpages, rule, scale)))
            oracle = mass.sum(1).clone()
            oracle[:, forced_t] = -1
            res.setdefault(f"oracle_group_sum@{f}", []).append(recall(oracle.topk(kpages, dim=1).indices))
        # twilight: quest(max) candidates at 25%, INT4 estimate, top-p
        kc = min(free, max(0, math.ceil(0.25 * ctx / N) - len(forced)))
        cand = reduce_and_pick(bounds, forced_t, kc, "max", scale)  # [Hkv, K]
        codes, sc, zr = quantize_int4(k[: p * N])
        khat = dequantize_int4(codes, sc, zr).view(p, N, hkv, d)
        for top_p in top_ps:
            kept_rec, kept_n = [], []
            for h in range(hkv):
                pages = torch.cat([forced_t, cand[h]])
                est = estimate_page_mass(q[:, h * g : (h + 1) * g], khat[pages, :, h].reshape(1, -1, d), N, scale)
                keep = top_p_keep(est[..., len(forced):], est[..., : len(forced)].sum(-1), top_p)[0]
                chosen = cand[h][keep]
                kept_rec.append(base[h] + mass[h][:, chosen].sum(-1))
                kept_n.append(int(keep.sum()))
            res.setdefault(f"twilight_p{top_p}", []).append(float(torch.stack(kept_rec).mean()))
            budgets.setdefault(f"twilight_p{top_p}", []).append(
                (len(forced) + sum(kept_n) / hkv) * N / ctx  # attended past share
            )
    mean = {k: sum(v) / len(v) for k, v in res.items()}
    return mean, {k: sum(v) / len(v) for k, v in budgets.items()}


def int4_error(seen):
    """Relative error of the INT4 shadows on the model's real keys, all layers."""
    num = den = 0.0
    dot_err = []
    for q, k in seen:
        codes, sc, zr = quantize_int4(k)
        khat = dequantize_int4(codes, sc, zr)
        num += float((khat - k).pow(2).sum())
        den += float(k.pow(2).sum())
        qq = q[-1].view(k.shape[1], -1, k.shape[-1])  # last query, [Hkv, G, D]
        exact = torch.einsum("hgd,shd->hgs", qq, k)
        approx = torch.einsum("hgd,shd->hgs", qq, khat)
        dot_err.append(float((approx - exact).abs().mean() / exact.abs().mean()))
    return math.sqrt(num / den), sum(dot_err) / len(dot_err)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "quest_recall_cpu.json"))
    args = ap.parse_args()
    t0 = time.time()
    seen, total = capture(args.tokens)
    t1 = time.time()
    rel, dot = int4_error(seen)
    out = {
        "model": "Qwen2.5-Coder-0.5B-Instruct (Hq 14, Hkv 2, d 64), fp32 on CPU",
        "text": TEXT.name,
        "tokens": total,
        "page_size": N,
        "sink_tokens": SINK,
        "local_tokens": LOCAL,
        "layers": f"1..{len(seen) - 1} (layer 0 dense)",
        "int4_key_rel_l2_error": rel,
        "int4_qk_mean_abs_rel_error_last_query": dot,
        "decode": {},
        "chunk64": {},
    }
    for name, chunk in (("decode", 1), ("chunk64", 64)):
        rec, bud = evaluate(seen, total, chunk, (0.0625, 0.125, 0.25), (0.8, 0.9, 0.95))
        out[name] = {"recall": rec, "twilight_attended_past_share": bud}
    out["seconds"] = {"capture": t1 - t0, "total": time.time() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
