"""Passkey retrieval: a number hidden at a chosen depth in a long haystack of filler text."""

from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? Answer with the number only."


@dataclass(frozen=True)
class PasskeySample:
    messages: list[dict[str, str]]
    passkey: str
    depth: float
    prompt_tokens: int

    def score(self, answer: str) -> float:
        return 1.0 if self.passkey in answer else 0.0


def make_passkey_sample(tokenizer, context_tokens: int, depth: float = 0.5, seed: int = 0) -> PasskeySample:
    """A chat prompt of about ``context_tokens`` tokens with the passkey at ``depth`` (0 = start, 1 = end).

    Args:
        tokenizer: a HuggingFace tokenizer with a chat template (the served model's).
    """
    rng = random.Random(seed)
    passkey = str(rng.randrange(10_000, 100_000))
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    intro = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
    filler_tokens = len(tokenizer.encode(FILLER, add_special_tokens=False))
    overhead = len(tokenizer.encode(intro + needle + "\n" + QUESTION, add_special_tokens=False)) + 32
    reps = max(1, (context_tokens - overhead) // filler_tokens)
    cut = round(reps * depth)
    haystack = FILLER * cut + needle + FILLER * (reps - cut)
    messages = [{"role": "user", "content": f"{intro}{haystack}\n{QUESTION}"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    n = len(tokenizer.encode(ids, add_special_tokens=False))
    return PasskeySample(messages, passkey, depth, n)
