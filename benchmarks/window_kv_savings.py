"""The KV memory a sliding-window-aware pool would free: `python -m benchmarks.window_kv_savings`.

cbjax's pool gives every layer the same block ids (a request's block table serves all layers), so a
block that a windowed layer's queries have slid past is still held for the full-attention layers and
is never freed (docs/caching.md, "Sliding windows"). This computes, from a preset's config alone,
the KV bytes one request holds at each context length today and what it would hold if the windowed
layers kept only the blocks their window can reach (ceil((window + block_size - 1) / block_size) + 1
blocks, the most a window can touch while a block is being filled), and their ratio.
"""

from __future__ import annotations

import argparse

from cbjax.bench.common import print_table, write_json
from cbjax.plan.capacity import load_model_config


def kv_bytes(config, context: int, block_size: int, itemsize: int, window_aware: bool) -> int:
    """K and V bytes one request of `context` tokens holds over all layers."""
    blocks = -(-context // block_size)
    per_block_layer = 2 * config.num_key_value_heads * block_size * config.head_dim * itemsize
    total = 0
    for layer in range(config.num_hidden_layers):
        window = config.sliding_window(layer)
        held = blocks if window is None or not window_aware else min(blocks, -(-(window + block_size - 1) // block_size) + 1)
        total += held * per_block_layer
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["mistral-7b-v0.1", "gemma-3-27b"])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 32768, 131072])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    rows = []
    for preset in args.presets:
        _, config = load_model_config(preset)
        windowed = sum(config.sliding_window(layer) is not None for layer in range(config.num_hidden_layers))
        for context in args.contexts:
            if context > config.max_position_embeddings:
                continue
            today, aware = (kv_bytes(config, context, args.block_size, 2, w) for w in (False, True))
            rows.append({"preset": preset, "windowed_layers": f"{windowed}/{config.num_hidden_layers}",
                         "context": context, "today_gib": today / 2**30, "window_aware_gib": aware / 2**30,
                         "freed": 1 - aware / today})
    print_table(rows, ["preset", "windowed_layers", "context", "today_gib", "window_aware_gib", "freed"])
    write_json(args.result_json, {"block_size": args.block_size, "kv_dtype": "bfloat16", "rows": rows})


if __name__ == "__main__":
    main()
