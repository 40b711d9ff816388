"""Stage 4, execute: the interface every executor implements."""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_sparse.policy import StepPlan
from vllm_sparse.tables import PageTables


class Executor(Protocol):
    def __call__(
        self,
        query: torch.Tensor,
        page_keys: torch.Tensor,
        page_values: torch.Tensor,
        tables: PageTables,
        plan: StepPlan,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """Attend every query to its row's pages, in place into ``output``.

        Args:
            query: ``[T, Hq, D]``.
            page_keys, page_values: ``[num_pages, N, D]`` by physical page id, read in place.
            tables: per-(request, KV head) page tables, request-major rows.
            plan: the step plan (query ranges per request).
            scale: softmax scale.
            output: ``[T, Hq, D]``, written.
        """
        ...
