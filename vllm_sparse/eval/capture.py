"""Capture a model's post-RoPE queries and keys on one prompt, with transformers on the CPU.

The prompt runs as vLLM's chunked prefill runs it (chunks of ``chunk_size`` tokens from position 0,
each attending to the cache of the ones before), then ``decode_steps`` greedy decode steps: each token
the model answers is fed back, so the queries at positions ``T .. T + decode_steps - 1`` are real decode
queries along the model's own (dense) answer, the first one over ``T + 1`` keys.

A custom attention function (transformers' ``AttentionInterface``, registered as
``vllm_sparse_capture``) sees every layer's queries after RoPE and the keys after the cache update,
records what the recall measure needs and hands the call to SDPA, so the model computes as before:

* ``keys[layer]``: ``[T + S, Hkv, D]`` every key of the prompt and of the ``S`` decode tokens;
* ``queries[layer]``: ``[T + S - keep_from, Hq, D]`` the queries from position ``keep_from`` on
  (the last prefill chunk and the decode tokens; earlier queries are not kept, to save memory).

Tensors are rounded to ``cache_dtype`` (vLLM keeps K in the model dtype, bfloat16 in the eval) and
kept as float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ATTENTION_NAME = "vllm_sparse_capture"


@dataclass
class Capture:
    """What one prompt left behind.

    Attributes:
        queries: per layer ``float32 [T + S - keep_from, Hq, D]``, position ``keep_from + i``.
        keys: per layer ``float32 [T + S, Hkv, D]``.
        keep_from: position of ``queries[l][0]``.
        prompt_len: ``T``; positions ``T .. T + S - 1`` are the decode tokens.
        decode_token: the token id the model answered first (greedy).
        scale: the layers' softmax scale.
        decode_tokens: the ``S`` token ids fed at the decode positions (greedy), the first one ``decode_token``.
    """

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    keep_from: int
    prompt_len: int
    decode_token: int
    scale: float
    decode_tokens: list[int] = field(default_factory=list)


class _Recorder:
    """The attention function's state: where the current chunk starts and what was kept so far."""

    def __init__(self, keep_from: int, cache_dtype: torch.dtype):
        self.keep_from = keep_from
        self.cache_dtype = cache_dtype
        self.offset = 0  # position of the current chunk's first token
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.scale = 1.0

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, scale: float) -> None:
        """``query [1, Hq, C, D]`` of the chunk, ``key [1, Hkv, S, D]`` every key so far."""
        self.scale = scale
        c = query.shape[2]
        skip = max(0, self.keep_from - self.offset)
        if skip < c:
            q = query[0, :, skip:].transpose(0, 1).to(self.cache_dtype).float()  # [C', Hq, D]
            self.queries.setdefault(layer, []).append(q)
        self.keys[layer] = key[0].transpose(0, 1)  # [S, Hkv, D] (a view of the cache)


_ACTIVE: list[_Recorder] = []


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """``AttentionInterface`` function: record, then SDPA (``query [B, Hq, C, D]``, ``key/value
    [B, Hkv, S, D]`` after the cache update)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _ACTIVE:
        _ACTIVE[-1].record(module.layer_idx, query, key, kwargs.get("scaling") or query.shape[-1] ** -0.5)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def load_model(path: str, dtype: torch.dtype = torch.float32, name: str = ATTENTION_NAME, attention=None):
    """The model (eval mode, capture attention) and its tokenizer from a HuggingFace folder.

    ``name`` and ``attention`` register another ``AttentionInterface`` function in place of the
    capture (``benchmarks/decode_tail_probe.py``: its own decode attention)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention or _capture_attention)
    # the mask SDPA gets (an unknown name gets none: chunks after the first would then be
    # masked top-left causal, i.e. blind to most of the cache)
    AttentionMaskInterface.register(name, sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=name)
    return model.eval(), AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def capture(model, ids: list[int], keep_from: int, chunk_size: int = 2048,
            cache_dtype: torch.dtype = torch.bfloat16, progress: bool = True, decode_steps: int = 1) -> Capture:  # fmt: skip
    """Run ``ids`` (``T`` prompt tokens) in chunks of ``chunk_size``, then ``decode_steps`` greedy decode steps.

    Args:
        model: from :func:`load_model`.
        ids: the prompt's token ids.
        keep_from: first position whose queries are kept (e.g. the last chunk's start).
        decode_steps: answer tokens fed back one at a time (``>= 1``).
    """
    if decode_steps < 1:
        raise ValueError(f"decode_steps must be at least 1, got {decode_steps}")
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    rec = _Recorder(keep_from, cache_dtype)
    _ACTIVE.append(rec)
    try:
        cache = DynamicCache(config=model.config)
        starts = list(range(0, len(ids), chunk_size))
        logits = None
        for start in tqdm(starts, desc="prefill chunks", disable=not progress, leave=False):
            rec.offset = start
            chunk = torch.tensor([ids[start : start + chunk_size]])
            out = model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits
        fed = []
        for step in range(decode_steps):
            fed.append(int(logits[0, -1].argmax()))
            rec.offset = len(ids) + step
            logits = model(input_ids=torch.tensor([[fed[-1]]]), past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits  # fmt: skip
    finally:
        _ACTIVE.remove(rec)
    layers = sorted(rec.keys)
    return Capture(
        queries=[torch.cat(rec.queries[i]) for i in layers],
        keys=[rec.keys[i].to(cache_dtype).float() for i in layers],
        keep_from=keep_from,
        prompt_len=len(ids),
        decode_token=fed[0],
        scale=rec.scale,
        decode_tokens=fed,
    )
