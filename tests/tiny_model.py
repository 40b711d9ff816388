"""A small random-weight Llama (GQA, head_dim 64) with a byte-level tokenizer, built locally.

For engine mechanics only: its outputs are noise, never evidence of accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_llama(
    path: Path, num_layers: int = 4, seed: int = 0, head_dim: int = 64, lm_head_std: float = 0.05
) -> Path:
    """Write config, random weights (fp32, std 0.05) and tokenizer to ``path``; reuse if present.

    ``head_dim`` 128 and ``lm_head_std`` 0.5 make a GPU model (FA3 and FlashInfer both run head dim
    128; wide logits keep greedy choices off near-ties in fp16, as ``benchmarks/e2e_gpu.py``'s)."""
    path = Path(path)
    if (path / "done").exists():
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    # Byte-level vocabulary: 256 byte symbols + specials, no merges.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=384,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=8192,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, lm_head_std if name.startswith("lm_head") else 0.05)
    model.save_pretrained(path, safe_serialization=True)
    (path / "done").write_text(json.dumps({"layers": num_layers, "seed": seed, "head_dim": head_dim,
                                           "lm_head_std": lm_head_std}))  # fmt: skip
    return path
