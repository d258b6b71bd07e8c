"""The mixture-of-experts layer's two expert matmuls at the engine's step shapes: grouped (sorted by
expert, jax.lax.ragged_dot) against dense-masked (every expert on every token).

    python -m benchmarks.moe_matmul --result-json bench_results/moe_matmul_cpu.json

For each config (tiny: the tests' 8 experts of 32; small: Mixtral's and Qwen3-MoE's expert counts at a
hidden size of 512; with --configs, the real Qwen3-30B-A3B and Mixtral-8x7B expert shapes, for a GPU) and each step's token count of the default buckets (compute_buckets(64, 512):
decode steps of 8-64 requests, mixed steps of 16-512 tokens), one jitted call of each formulation
(cbjax/models/layers/moe.py) on the same random tokens, routing and weights, timed alternately
(median of --calls per round, --rounds rounds). `dense_over_grouped` is dense-masked ms over grouped
ms: above 1, grouped is faster. The result decides MOE_MATMUL_BY_PLATFORM for this platform.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

from benchmarks.cpu_steps import median_ms
from cbjax.bench.common import print_table, write_json
from cbjax.models.layers.moe import MOE_MATMULS, route
from cbjax.worker.compilation.buckets import compute_buckets

# name: (hidden, num_experts, top_k, expert inner width)
CONFIGS = {
    "tiny": (64, 8, 2, 32),
    "small-mixtral": (512, 8, 2, 1024),
    "small-qwen3-moe": (512, 64, 8, 128),
    "qwen3-30b-a3b": (2048, 128, 8, 768),  # real sizes, for a GPU
    "mixtral-8x7b": (4096, 8, 2, 14336),
}
DEFAULT_CONFIGS = ["tiny", "small-mixtral", "small-qwen3-moe"]


def step_token_counts(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Every token count a compiled step of the default engine runs."""
    return sorted({bucket.num_tokens for bucket in compute_buckets(max_num_seqs, max_num_batched_tokens)})


def case(config: tuple[int, int, int, int], num_tokens: int, dtype: str, calls: int, rounds: int) -> dict:
    """Both formulations jitted on one random step; each's ms, median over rounds."""
    hidden, num_experts, top_k, inner = config
    keys = jax.random.split(jax.random.key(num_tokens), 5)
    x = jax.random.normal(keys[0], (num_tokens, hidden), jnp.float32)
    gate, up = (jax.random.normal(k, (num_experts, hidden, inner), jnp.float32).astype(dtype) for k in keys[1:3])
    down = jax.random.normal(keys[3], (num_experts, inner, hidden), jnp.float32).astype(dtype)
    weights, experts = route(jax.random.normal(keys[4], (num_tokens, num_experts)), top_k, renormalize=True)
    jitted = {name: jax.jit(lambda *a, f=fn: f(*a, jnp.float32)) for name, fn in MOE_MATMULS.items()}
    args = (x, weights, experts, gate, up, down)
    ms = {name: [] for name in jitted}
    for _ in range(rounds):
        for name, call in jitted.items():
            ms[name].append(median_ms(lambda call=call: call(*args), calls))
    return {name: statistics.median(values) for name, values in ms.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the expert weights' (bfloat16 as the engine's CPU bf16 mode: float32 activations)")
    p.add_argument("--calls", type=int, default=9)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    rows = []
    for name in args.configs:
        for num_tokens in step_token_counts(args.max_num_seqs, args.max_num_batched_tokens):
            ms = case(CONFIGS[name], num_tokens, args.dtype, args.calls, args.rounds)
            rows.append({"config": name, "tokens": num_tokens, "grouped_ms": ms["grouped"],
                         "dense_masked_ms": ms["dense_masked"], "dense_over_grouped": ms["dense_masked"] / ms["grouped"]})
    print_table(rows, ["config", "tokens", "grouped_ms", "dense_masked_ms", "dense_over_grouped"])
    write_json(args.result_json, {"platform": jax.devices()[0].platform, "device": jax.devices()[0].device_kind,
                                  "dtype": args.dtype, "configs": {n: CONFIGS[n] for n in args.configs},
                                  "calls": args.calls, "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
