"""Dense answers of the 1.5B past 32K on this CPU: the YaRN twin (NAME@yarn4) against the plain model.

python check.py 40000 qwen2.5-coder-1.5b-instruct@yarn4 qwen2.5-coder-1.5b-instruct
"""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_sparse.eval.models import resolve_model
from vllm_sparse.eval.tasks import make_samples


def main() -> None:
    ctx, names = int(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(2)
    out = []
    for name in names:
        path = resolve_model(name, progress=False)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        for task, depth in (("niah_single", 0.5), ("niah_single", 0.1)):
            s = make_samples(tok, task, ctx, 1, (depth,), 0)[0]
            ids = torch.tensor([tok.encode(s.prompt, add_special_tokens=False)])
            t = time.perf_counter()
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=s.max_tokens, do_sample=False)
            text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
            rec = {"model": name, "task": task, "depth": depth, "prompt_tokens": ids.shape[1],
                   "expected": list(s.expected), "output": text, "score": s.score(text),
                   "seconds": round(time.perf_counter() - t, 1)}  # fmt: skip
            print(json.dumps(rec), flush=True)
            out.append(rec)
        del model
    with open(f"check_{ctx}.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
