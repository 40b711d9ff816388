"""Accuracy evaluation: models from PyPI, seeded long-context tasks, dense vs sparse runs, reports with 95%
intervals (``intervals.py``, ``cells.py``), and the attention-recall measure of the selectors on real queries
and keys (``recall*.py``, ``vllm-sparse recall``).

Python API (vLLM is imported only when a run starts)::

    from vllm_sparse.eval import EvalConfig, default_backends, run_eval

    if __name__ == "__main__":  # vLLM spawns its engine process
        cfg = EvalConfig(model="qwen2.5-coder-0.5b-instruct", contexts=(4096, 8192), samples=2,
                         backends=default_backends(budgets=(0.125, 0.25)), out_dir="eval_out")
        print(run_eval(cfg).markdown)
"""

from vllm_sparse.eval.runner import Backend, EvalConfig, EvalResult, default_backends, run_eval
from vllm_sparse.eval.tasks import TASKS, Sample, make_samples, score

__all__ = ["TASKS", "Backend", "EvalConfig", "EvalResult", "Sample", "default_backends", "make_samples", "run_eval",
           "score"]  # fmt: skip
