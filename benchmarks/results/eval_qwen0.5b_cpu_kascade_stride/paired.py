"""Paired difference of one backend against another per task, on the prompts both answered (matched by task,
context and prompt hash), from one or more eval samples.json files.

python benchmarks/results/eval_qwen0.5b_cpu_kascade_stride/paired.py LABEL BASELINE SAMPLES_JSON [SAMPLES_JSON ...]
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from vllm_sparse.eval.intervals import paired_difference  # noqa: E402


def main(label: str, baseline: str, paths: list[str]) -> dict:
    by_prompt = defaultdict(dict)
    for path in paths:
        for s in json.loads(Path(path).read_text()):
            by_prompt[(s["task"], s["context"], s["prompt_hash"])][s["backend"]] = s["score"]
    out = {}
    for task in sorted({k[0] for k in by_prompt}) + ["all"]:
        pairs = [(v[label], v[baseline]) for k, v in by_prompt.items()
                 if (task == "all" or k[0] == task) and label in v and baseline in v]  # fmt: skip
        if pairs:
            a, b = [x for x, _ in pairs], [y for _, y in pairs]
            iv = paired_difference(a, b)
            out[task] = {"n": len(pairs), label: sum(a) / len(a), baseline: sum(b) / len(b), "diff": iv.mean,
                         "lo": iv.lo, "hi": iv.hi, "method": iv.method, "differ": sum(x != y for x, y in pairs)}  # fmt: skip
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:]), indent=1))
