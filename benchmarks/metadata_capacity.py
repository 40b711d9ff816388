"""KV capacity cost of the page metadata (Quest min/max, Twilight INT4 shadows), in tokens.

Metadata lives in extra head slots of every block (``customize_spec``), so vLLM's memory planner
fits fewer blocks into the same KV memory. This counts, per method, the bytes of one block, the
tokens that fit per GiB of KV memory and the capacity lost against dense, both with whole head
slots (what vLLM allocates) and for the planes' bytes alone (the floor a tighter packing reaches).

    python benchmarks/metadata_capacity.py [--out benchmarks/results/metadata_capacity.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_sparse.layout import MetaPlanes

GIB = 1 << 30
LLAMA_31_8B = {"num_layers": 32, "num_q_heads": 32, "num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"}


def capacity(shape: dict, method: str, page_size: int) -> dict:
    dtype = getattr(torch, shape["dtype"])
    hkv, d, layers = shape["num_kv_heads"], shape["head_size"], shape["num_layers"]
    slot_bytes = page_size * 2 * d * dtype.itemsize
    kv_block = hkv * slot_bytes
    planes = MetaPlanes.for_method(method, hkv, page_size, d, dtype)
    slots = 0 if planes is None else planes.num_slots
    plane_bytes = 0 if planes is None else planes.num_bytes
    block_bytes = (hkv + slots) * slot_bytes  # one layer
    per_token = block_bytes * layers / page_size
    ideal_per_token = (kv_block + plane_bytes) * layers / page_size
    dense_per_token = kv_block * layers / page_size
    return {
        "method": method,
        "page_size": page_size,
        "meta_head_slots": slots,
        "meta_bytes_per_block_layer": plane_bytes,
        "block_bytes_per_layer": block_bytes,
        "kv_bytes_per_token_all_layers": per_token,
        "tokens_per_gib": GIB / per_token,
        "tokens_lost_per_gib_vs_dense": GIB / dense_per_token - GIB / per_token,
        "capacity_vs_dense": dense_per_token / per_token,
        # memory of the metadata of one 128K-token sequence, counted in dense KV tokens
        "metadata_in_tokens_per_128k_context": 131072 * slots / hkv,
        "ideal_tokens_per_gib_unpadded": GIB / ideal_per_token,
        "ideal_capacity_vs_dense_unpadded": dense_per_token / ideal_per_token,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "metadata_capacity.json"))
    args = ap.parse_args()
    rows = [capacity(LLAMA_31_8B, m, p) for p in (16, 32) for m in ("quoka", "quest", "twilight")]
    result = {
        "model_shapes": {"name": "Llama-3.1-8B", **LLAMA_31_8B},
        "layout": "extra head slots per block (customize_spec num_head_slots); planes 16-byte aligned",
        "int4_grouping": "per token and KV head over D channels; fp16 scale and zero",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['method']:9s} page {r['page_size']:2d}: +{r['meta_head_slots']} slot(s), "
            f"{r['tokens_per_gib']:8.1f} tokens/GiB ({100 * r['capacity_vs_dense']:.1f}% of dense; "
            f"unpadded floor {100 * r['ideal_capacity_vs_dense_unpadded']:.1f}%)"
        )


if __name__ == "__main__":
    main()
