"""Fit ``vllm_sparse.cost`` coefficients to a ``step_breakdown_gpu.py`` result and print them
with each point's measured and modelled times and the break-even contexts.

    python benchmarks/fit_prefill_cost.py benchmarks/results/step_breakdown_h100/step_breakdown_gpu.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_sparse.config import SparseConfig
from vllm_sparse.cost import PrefillCost, scoring_queries

N = 16
# chunk_query_window of the step_breakdown runs that fitted the shipped coefficients (the defaults before
# QuoKA and Quest moved to 64): the fit must cap the scoring queries as those runs did
MEASURED_WINDOW = {"twilight": 64}


def kept_tokens(r: dict) -> int:
    """Past tokens the chunk's rows attend: planned pages minus the chunk's own pages."""
    chunk_pages = r["pages_dense"] - r["context"] // N
    return (r["pages_planned"] - chunk_pages) * N


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (drop a negative one, refit)."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active] / y[:, None], np.ones(len(y)), rcond=None)[0]  # relative error
        neg = [i for i in active if coef[i] < 0]
        if not neg:
            return coef
        active.remove(min(neg, key=lambda i: coef[i]))


def main() -> None:
    doc = json.loads(Path(sys.argv[1]).read_text())
    rows = [r for r in doc["results"] if r["phase"] == "prefill"]
    q = np.array([r["query_len"] for r in rows], float)
    ctx = np.array([r["context"] for r in rows], float)
    dense_us = np.array([r["dense_ms"] for r in rows]) * 1e3
    a = float(nnls((q * (ctx + q / 2) / 1e6)[:, None], dense_us)[0])
    print(f"{doc['gpu']}: dense a = {a:.4f} us per million query-key pairs")
    for method in sorted({r["method"] for r in rows}):
        rs = [r for r in rows if r["method"] == method and r["sparse"]]
        s_cap = scoring_queries(SparseConfig(method=method, chunk_query_window=MEASURED_WINDOW.get(method, 0)))
        qm = np.array([r["query_len"] for r in rs], float)
        cm = np.array([r["context"] for r in rs], float)
        km = np.array([kept_tokens(r) for r in rs], float)
        sm = qm if s_cap is None else np.minimum(qm, s_cap)
        x = np.stack([qm * (km + qm / 2) / 1e6, sm * cm / 1e6, qm / 1e3, np.ones_like(qm)], axis=1)
        y = np.array([r["forward_ms"] for r in rs]) * 1e3
        b, c, e, f = (float(v) for v in nnls(x, y))
        model = PrefillCost(a, b, c, e, f, s_cap)
        print(f"  ({method!r}): ({a:.4f}, {b:.4f}, {c:.4f}, {e:.4f}, {f:.1f}),")
        for r, k in zip(rs, km):
            sp = model.sparse_us(r["query_len"], r["context"], int(k))
            print(
                f"    q {r['query_len']:>5} ctx {r['context']:>6}: sparse {r['forward_ms'] * 1e3:8.0f} us, model {sp:8.0f}"
                f" | dense {r['dense_ms'] * 1e3:8.0f}, model {model.dense_us(r['query_len'], r['context']):8.0f}"
                f" -> {'sparse' if model.sparse_pays(r['query_len'], r['context'], int(k)) else 'dense'}"
            )


if __name__ == "__main__":
    main()
