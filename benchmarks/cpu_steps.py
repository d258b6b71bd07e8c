"""The CPU A/B measurements behind BENCHMARKS.md section 7, in one command.

    python -m benchmarks.cpu_steps --model checkpoints/smollm2-135m-instruct --result-json bench_results/cpu_steps.json

Part 1, the jnp attention of one layer at SmolLM2's shapes (9 query heads, 3 KV heads, head_dim
64, block 16), compiled alone: KV tile sizes for decodes, query tiles (block_q) for prefill and
mixed batches, one-token requests of a mixed step through the decode path against a query tile
each, a float32 against a float16 pool, and the C++ kernel (kernels_cpu) on the same cases.
Part 2, one whole decode step of the real model (weights, KV write, attention, LM head) with
float32 weights against bf16 weights under float32 activations, and with bf16 weights the jnp
attention against the C++ kernel. Every variant is timed in this process, variants interleaved over
`--rounds`, medians of `--repeats` calls each; ms.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.checkpoint.loader import load_model
from cbjax.models.layers.kv_pool import init_kv_pool
from kernels_cpu import ragged_paged_attention_cpu
from cbjax.models.layers.attention import AttentionPlan
from kernels_pallas.reference import (
    AttentionMetadata,
    mixed_paged_attention_reference,
    ragged_paged_attention_reference,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def median_ms(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def attention_case(requests: list[tuple[int, int]], num_tokens: int, kv_dtype: str, max_len: int = 1024):
    """(q_len, seq_len) per request, each on its own pages of a pool sized for max_len tokens each."""
    per_req = max_len // BLOCK
    num_reqs = len(requests)
    key = jax.random.PRNGKey(0)
    k_pages = jax.random.normal(key, (KV_HEADS, num_reqs * per_req + 1, BLOCK, HEAD_DIM)).astype(kv_dtype)
    block_tables = np.zeros((num_reqs, per_req), np.int32)
    query_start_loc = np.zeros(num_reqs + 1, np.int32)
    for r, (q_len, seq_len) in enumerate(requests):
        block_tables[r, : -(-seq_len // BLOCK)] = 1 + r * per_req + np.arange(-(-seq_len // BLOCK))
        query_start_loc[r + 1] = query_start_loc[r] + q_len
    metadata = AttentionMetadata(
        jnp.zeros(num_tokens, jnp.int32), jnp.asarray(query_start_loc),
        jnp.array([s for _, s in requests], jnp.int32), jnp.asarray(block_tables),
    )
    q = jax.random.normal(jax.random.PRNGKey(1), (num_tokens, HEADS, HEAD_DIM))
    return q, k_pages, k_pages + 1, metadata


def attention_variants() -> dict[str, tuple]:
    """name -> (requests, num_tokens, kv dtype, kwargs); `split` picks mixed_paged_attention_reference, `cpp` the C++ kernel."""
    variants = {}
    for num_reqs, ctx in [(256, 60), (32, 200), (16, 400)]:
        for tile in (16, 128):
            variants[f"decode {num_reqs}x{ctx}, tile {tile}"] = ([(1, ctx)] * num_reqs, num_reqs, "float32", dict(tile_tokens=tile))
        for kv in ("float32", "float16"):
            variants[f"decode {num_reqs}x{ctx}, default tile, {kv} pool"] = ([(1, ctx)] * num_reqs, num_reqs, kv, {})
    prefill = [(512, 600)] + [(0, 0)] * 7
    mixed = [(1, 300)] * 64 + [(448, 448)]
    for block_q in (1, 8, 16):
        variants[f"prefill 512 over 600, block_q {block_q}"] = (prefill, 512, "float32", dict(block_q=block_q))
        variants[f"mixed 64 decodes + 448 chunk, block_q {block_q}"] = (mixed, 512, "float32", dict(block_q=block_q))
    small = [(1, 151)] * 15 + [(100, 100)]
    for block_q in (8, 16):
        variants[f"mixed 15 decodes + 100 chunk, block_q {block_q}"] = (small, 128, "float16", dict(block_q=block_q))
    # One-token requests through the decode path, prompt chunks in query tiles (the engine's mixed steps).
    variants["mixed 64 decodes + 448 chunk, decodes apart, block_q 16"] = (
        mixed, 512, "float16", dict(block_q=16, max_prefill_reqs=8, split=True))
    variants["mixed 64 decodes + 448 chunk, every request a tile, block_q 8"] = (mixed, 512, "float16", dict(block_q=8))
    # The C++ kernel on the cases the engine's steps look like (float16 pool).
    for num_reqs, ctx in [(256, 60), (32, 200), (16, 400), (16, 100)]:
        variants[f"decode {num_reqs}x{ctx}, float16 pool, jnp"] = ([(1, ctx)] * num_reqs, num_reqs, "float16", {})
        variants[f"decode {num_reqs}x{ctx}, float16 pool, C++"] = ([(1, ctx)] * num_reqs, num_reqs, "float16", dict(cpp=True))
    variants["mixed 15 decodes + 100 chunk, C++"] = (small, 128, "float16", dict(cpp=True))
    variants["mixed 64 decodes + 448 chunk, C++"] = (mixed, 512, "float16", dict(cpp=True))
    variants["prefill 512 over 600, float16 pool, C++"] = (prefill, 512, "float16", dict(cpp=True))
    return variants


def decode_step_variants(model_dir: str, batches: list[int], context: int) -> dict[str, object]:
    """name -> a zero-argument function running one decode step of the real model."""
    variants = {}
    for dtype, backend in (("float32", "xla"), ("bfloat16", "xla"), ("bfloat16", "cpp")):
        model, config = load_model(model_dir, dtype=dtype, activation_dtype="float32")
        graphdef, state = nnx.split(model)
        for num_reqs in batches:
            per_req = -(-(context + 1) // BLOCK)
            block_tables = 1 + np.arange(num_reqs * per_req, dtype=np.int32).reshape(num_reqs, per_req)
            metadata = AttentionMetadata(
                slot_mapping=jnp.asarray(block_tables[:, context // BLOCK] * BLOCK + context % BLOCK),
                query_start_loc=jnp.arange(num_reqs + 1, dtype=jnp.int32),
                seq_lens=jnp.full((num_reqs,), context + 1, jnp.int32),
                block_tables=jnp.asarray(block_tables),
            )
            box = {"kv": init_kv_pool(config, num_reqs * per_req + 1, BLOCK, jnp.float32)}
            tokens = jnp.arange(num_reqs, dtype=jnp.int32)
            positions = jnp.full((num_reqs,), context, jnp.int32)

            @functools.partial(jax.jit, donate_argnums=(1,))
            def step(state, kv, tokens, positions, metadata, graphdef=graphdef, backend=backend):
                plan = AttentionPlan(backend, decode_only=True)
                logits, kv = nnx.merge(graphdef, state)(tokens, positions, kv, metadata, tokens, plan)
                return kv, logits

            def run(step=step, state=state, box=box, tokens=tokens, positions=positions, metadata=metadata):
                box["kv"], logits = step(state, box["kv"], tokens, positions, metadata)
                return logits

            attention = "jnp" if backend == "xla" else "C++"
            variants[f"decode step {num_reqs} requests x {context} tokens, {dtype} weights, {attention} attention"] = run
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_steps", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--result-json", type=pathlib.Path, default=None)
    parser.add_argument("--only", default=None,
                        help="run only the one-layer attention cases whose name contains this (e.g. 'C++'), no whole step")
    args = parser.parse_args(argv)

    runs = {}
    for name, (requests, num_tokens, kv_dtype, kwargs) in attention_variants().items():
        if args.only is not None and args.only not in name:
            continue
        q, k, v, metadata = attention_case(requests, num_tokens, kv_dtype)
        kwargs = dict(kwargs)
        if kwargs.pop("cpp", False):
            reference = ragged_paged_attention_cpu
        else:
            reference = mixed_paged_attention_reference if kwargs.pop("split", False) else ragged_paged_attention_reference
        f = jax.jit(functools.partial(reference, sm_scale=HEAD_DIM**-0.5, **kwargs))
        runs[f"attention (one layer): {name}"] = functools.partial(f, q, k, v, metadata)
    if args.only is None:
        runs |= decode_step_variants(args.model, args.batches, args.context)
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            results[name].append(median_ms(fn, args.repeats))
    for name, values in results.items():
        print(f"{name:70s} " + " / ".join(f"{v:8.2f}" for v in values) + " ms")
    if args.result_json:
        args.result_json.write_text(json.dumps({"unit": "ms", "rounds": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
