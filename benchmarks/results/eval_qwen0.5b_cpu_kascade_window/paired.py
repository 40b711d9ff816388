"""Paired difference of kascade_w64 against kascade_w0 per task, on the same prompts of an eval's samples.json.

python benchmarks/results/eval_qwen0.5b_cpu_kascade_window/paired.py SAMPLES_JSON
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from vllm_sparse.eval.intervals import paired_difference  # noqa: E402


def main(path: str) -> dict:
    by_prompt = defaultdict(dict)
    for s in json.loads(Path(path).read_text()):
        by_prompt[(s["task"], s["context"], s["prompt_hash"])][s["backend"]] = s["score"]
    out = {}
    for task in sorted({k[0] for k in by_prompt}) + ["all"]:
        pairs = [(v["kascade_w64"], v["kascade_w0"]) for k, v in by_prompt.items()
                 if (task == "all" or k[0] == task) and len(v) == 2]  # fmt: skip
        if pairs:
            w64, w0 = [a for a, _ in pairs], [b for _, b in pairs]
            iv = paired_difference(w64, w0)
            out[task] = {"n": len(pairs), "w64": sum(w64) / len(pairs), "w0": sum(w0) / len(pairs),
                         "diff": iv.mean, "lo": iv.lo, "hi": iv.hi, "method": iv.method,
                         "differ": sum(a != b for a, b in pairs)}  # fmt: skip
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), indent=1))
