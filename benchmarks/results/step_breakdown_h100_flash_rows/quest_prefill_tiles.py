"""Tile configs of the Quest prefill bounds kernel at 8192 queries x 7680 pages (one H100; run from the
repository root as ``python3 quest_prefill_tiles.py`` with ``benchmarks`` importable; output in
``quest_prefill_tiles.log``). It chose the 64 x 128 tiles of ``kernels/quest_score.py`` for long contexts."""

import json
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
from gpu_timing import Timer  # noqa: E402

from vllm_sparse.kernels import quest_score as qs  # noqa: E402

HQ, HKV, D, N = 32, 8, 128, 16
q = torch.randn(8192, HQ, D, device="cuda", dtype=torch.bfloat16)
nb = 8192
kmin = torch.randn(nb, HKV, D, device="cuda", dtype=torch.bfloat16)
kmax = kmin + torch.rand_like(kmin)
blocks = torch.randperm(nb, device="cuda")[:7680].int()
out = torch.empty(HKV, 4, 7680, device="cuda", dtype=torch.float32)
t = Timer(5)
res = []
ref = qs.page_upper_bounds_triton(q, kmin, kmax, blocks)
res.append({"cfg": "default", "ms": t(lambda: qs.page_upper_bounds_triton(q, kmin, kmax, blocks))})
configs = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (64, 128, 8, 3),
           (128, 128, 8, 3), (128, 128, 8, 2)]  # fmt: skip
for bq, bp, nw, ns in configs:

    def run(bq=bq, bp=bp, nw=nw, ns=ns):
        qs._quest_bounds_kernel[(HKV, triton.cdiv(7680, bp))](
            q, kmin, kmax, blocks, blocks, blocks, out, 8192, 7680, HKV, q.stride(0), q.stride(1), 0,
            kmin.stride(0), kmin.stride(1), G=4, D=D, BLOCK_D=D, BLOCK_G=4, BLOCK_Q=bq, BLOCK_P=bp,
            HAS_TOKENS=False, HAS_NPAGES=False, LOW_PRECISION=True, num_warps=nw, num_stages=ns,
        )  # fmt: skip

    try:
        run()
        torch.cuda.synchronize()
        res.append({"cfg": [bq, bp, nw, ns], "ms": t(run), "equal": torch.equal(out, ref)})
    except Exception as e:  # noqa: BLE001
        res.append({"cfg": [bq, bp, nw, ns], "error": str(e)[:200]})
    print(json.dumps(res[-1]), flush=True)
print(json.dumps(res))
