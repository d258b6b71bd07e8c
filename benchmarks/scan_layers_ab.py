"""Scanned against unrolled layer stack (issue 11): compile time, compile RSS and step speed, side by side.

The scanned stack is a prototype kept here, not in the engine (it lost on step speed: BENCHMARKS.md
section 14): the 30 layers' weights stacked along a leading axis (a copy made at start-up), one
layer body under `jax.lax.scan`, and the KV pool as one K and one V array with a leading layer
axis, carried through the loop and updated at the layer's index. The unrolled stack is the
engine's `LlamaForCausalLM.hidden_states`. Both run the C++ CPU attention kernel, then the final
norm and head on the last two rows (as the engine's steps do, never one: a one-row bf16 dot is
about 10x slower than a two-row one on XLA:CPU, BENCHMARKS.md section 7).

- compile: each variant compiles the three step shapes (decode 16 and 64 rows, a 256-token
  prompt) in a fresh subprocess without a compilation cache, alternated: seconds, and the RSS
  the compiles added (the peak RSS while compiling, reset just before, minus the RSS then; the
  scanned side's stacked copy of the weights is made before, so it is not counted).
- step: one process holds both variants' executables and calls them alternately; medians.
- pool size: XLA:CPU hands the kernel each layer's pool as a copy inside the loop, so a 16-block
  pool shows the cost that is left when that copy is nearly free (the layer weights' copies).

    python benchmarks/scan_layers_ab.py --rounds 9 --out scan_layers_ab.json
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time

import numpy as np

CHECKPOINT = "checkpoints/smollm2-135m-instruct"
BLOCK_SIZE = 16
MAX_BLOCKS_PER_SEQ = 64
SHAPES = {"decode16": (16, 1, 200), "decode64": (64, 1, 200), "prefill256": (1, 256, 256)}  # rows, tokens per row, context
VARIANTS = ("unrolled", "scanned")


def status_mib(field: str) -> float:
    """VmRSS (resident now) or VmHWM (peak resident since start or the last reset_peak_rss) in MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux 4.0+), so the next peak is the compiles' alone."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def build(dtype: str, num_blocks: int):
    """Both variants as (jitted forward, its weights, its pool), and the inputs of each shape."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cbjax.checkpoint.loader import load_model
    from cbjax.models.layers.kv_pool import init_kv_pool
    from cbjax.models.layers.attention import AttentionPlan
    from kernels_pallas.reference import AttentionMetadata

    model, config = load_model(CHECKPOINT, dtype, "float32")
    graphdef, state = nnx.split(model)
    layer_graphdef, _ = nnx.split(model.model.layers[0])
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *[nnx.split(layer)[1] for layer in model.model.layers])
    caches = init_kv_pool(config, num_blocks, BLOCK_SIZE, jnp.float32)
    pool = (jnp.stack([k for k, _ in caches]), jnp.stack([v for _, v in caches]))
    plan = AttentionPlan("cpp", False)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def unrolled(weights, caches, token_ids, positions, metadata):
        model = nnx.merge(graphdef, weights)
        hidden, caches = model.hidden_states(token_ids, positions, caches, metadata, plan)
        return model.compute_logits(hidden[-2:]), caches

    @functools.partial(jax.jit, donate_argnums=(1,))
    def scanned(weights, pool, token_ids, positions, metadata):
        state, stacked = weights  # the per-layer weights in `state` are passed but never read
        model = nnx.merge(graphdef, state)
        x = model.model.embed_tokens.embedding[...][token_ids].astype(model.activation_dtype)

        def layer_step(carry, layer_state):
            x, k_pool, v_pool, index = carry
            layer_pages = tuple(jax.lax.dynamic_index_in_dim(p, index, keepdims=False) for p in (k_pool, v_pool))
            x, (k_pages, v_pages) = nnx.merge(layer_graphdef, layer_state)(x, positions, layer_pages, metadata, plan)
            k_pool = jax.lax.dynamic_update_index_in_dim(k_pool, k_pages, index, 0)
            v_pool = jax.lax.dynamic_update_index_in_dim(v_pool, v_pages, index, 0)
            return (x, k_pool, v_pool, index + 1), None

        (x, k_pool, v_pool, _), _ = jax.lax.scan(layer_step, (x, *pool, jnp.int32(0)), stacked)
        return model.compute_logits(x[-2:]), (k_pool, v_pool)

    def inputs(rows: int, tokens_per_row: int, context: int):
        pages = -(-context // BLOCK_SIZE)
        tables = np.zeros((rows, MAX_BLOCKS_PER_SEQ), np.int32)
        for r in range(rows):
            tables[r, :pages] = 1 + (np.arange(pages) + r * pages) % (num_blocks - 1)
        positions = np.concatenate([np.arange(context - tokens_per_row, context)] * rows).astype(np.int32)
        rows_of = np.repeat(np.arange(rows), tokens_per_row)
        slots = tables[rows_of, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        metadata = AttentionMetadata(
            jnp.asarray(slots, jnp.int32), jnp.asarray(np.arange(rows + 1) * tokens_per_row, jnp.int32),
            jnp.full(rows, context, jnp.int32), jnp.asarray(tables),
        )
        return jnp.asarray(positions % 1000, jnp.int32), jnp.asarray(positions), metadata

    variants = {"unrolled": [unrolled, state, caches], "scanned": [scanned, (state, stacked), pool]}
    return variants, {name: inputs(*shape) for name, shape in SHAPES.items()}


def compile_child(variant: str, dtype: str, num_blocks: int) -> dict:
    """In a fresh process: compile every shape of one variant; seconds and RSS."""
    variants, inputs = build(dtype, num_blocks)
    forward, weights, pool = variants[variant]
    before = status_mib("VmRSS")
    reset_peak_rss()
    seconds = {}
    for shape, args in inputs.items():
        start = time.perf_counter()
        forward.lower(weights, pool, *args).compile()
        seconds[shape] = time.perf_counter() - start
    peak = status_mib("VmHWM")
    return {"compile_s": seconds, "compile_total_s": sum(seconds.values()), "rss_before_mib": before,
            "peak_rss_mib": peak, "compile_added_mib": peak - before}


def step_speed(dtype: str, num_blocks: int, rounds: int) -> dict:
    """Both variants' compiled steps called alternately at every shape; medians in ms and the ratio."""
    import jax.numpy as jnp

    variants, inputs = build(dtype, num_blocks)
    result = {}
    for shape, args in inputs.items():
        compiled = {name: variants[name][0].lower(variants[name][1], variants[name][2], *args).compile() for name in VARIANTS}
        logits = {}
        for name in VARIANTS:  # first call of each (one-off costs), and the two must agree
            forward, weights, pool = compiled[name], variants[name][1], variants[name][2]
            logits[name], variants[name][2] = forward(weights, pool, *args)
        times = {name: [] for name in VARIANTS}
        for _ in range(rounds):
            for name in VARIANTS:
                start = time.perf_counter()
                out, variants[name][2] = compiled[name](variants[name][1], variants[name][2], *args)
                out.block_until_ready()
                times[name].append(time.perf_counter() - start)
        medians = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
        result[shape] = {**{f"{name}_ms": medians[name] for name in VARIANTS},
                         "scanned_over_unrolled": medians["scanned"] / medians["unrolled"],
                         "max_logit_diff": float(jnp.abs(logits["scanned"] - logits["unrolled"]).max())}
        print(dtype, num_blocks, shape, result[shape], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="alternated step timings per shape")
    parser.add_argument("--compile-rounds", type=int, default=2, help="fresh compile subprocesses per variant and dtype")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--pool-blocks", nargs="+", type=int, default=[512, 16])
    parser.add_argument("--out", default="scan_layers_ab.json")
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "DTYPE", "BLOCKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(compile_child(args.child[0], args.child[1], int(args.child[2]))))
        return
    results = {"command": " ".join(sys.argv), "compile": {}, "step": {}}
    for dtype in args.dtypes:
        runs = {name: [] for name in VARIANTS}
        for _ in range(args.compile_rounds):
            for name in VARIANTS:
                child = subprocess.run([sys.executable, __file__, "--child", name, dtype, str(args.pool_blocks[0])],
                                       capture_output=True, text=True, check=True)
                runs[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
                print(dtype, name, runs[name][-1], flush=True)
        results["compile"][dtype] = {
            name: {"runs": r, "median_compile_total_s": float(np.median([x["compile_total_s"] for x in r])),
                   "median_compile_added_mib": float(np.median([x["compile_added_mib"] for x in r]))}
            for name, r in runs.items()
        }
        for blocks in args.pool_blocks:
            results["step"][f"{dtype}_pool{blocks}"] = step_speed(dtype, blocks, args.rounds)
    with open(args.out, "w") as file:
        json.dump(results, file, indent=1)
    print(json.dumps({k: v for k, v in results.items() if k != "compile"}, indent=1))
    for dtype, by_variant in results["compile"].items():
        print(dtype, {name: (round(v["median_compile_total_s"], 2), round(v["median_compile_added_mib"])) for name, v in by_variant.items()})


if __name__ == "__main__":
    main()
