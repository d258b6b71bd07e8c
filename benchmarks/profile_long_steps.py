"""Where a SmolLM2 step's time goes at the 64-sequence, long-context shapes (issue 14), and at short decodes.

    PYTHONPATH=. python benchmarks/profile_long_steps.py --model checkpoints/smollm2-135m-instruct \
        --result-json bench_results/profile_long_steps.json
    python -m benchmarks.profile_long_steps --model downloads/SmolLM2-135M-Instruct.Q4_1.gguf --dtype float32 \
        --packed --cases "decode 1 x 64" "decode 16 x 64"     # a GGUF file as stored (the engine's form of it)

Each case is one compiled step of the real model (bf16 weights, float32 activations, float16
pool, the C++ attention kernel; `--dtype float32` for float32 weights, `--packed` for the projections packed
for the C++ matmul as the engine packs them; a .gguf --model is served as stored), timed whole (median of
--repeats calls, each writing into the pool the last returned, as the engine's donated steps do), then traced
once with jax.profiler and its XLA:CPU ops summed by kind (dots, fusions, ...; each C++ custom call by its
kernel).
"""

from __future__ import annotations

import argparse
import collections
import functools
import pathlib
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.bench.common import write_json
from cbjax.checkpoint.loader import load_model
from cbjax.checkpoint.resolve import resolve_model
from cbjax.models.layers.kv_pool import init_kv_pool
from cbjax.models.layers.attention import AttentionPlan
from kernels_pallas.reference import AttentionMetadata

BLOCK = 16

# name -> [(new tokens, context length after them)] per request
CASES = {
    "decode 64 x 500": [(1, 500)] * 64,
    "decode 16 x 200": [(1, 200)] * 16,
    "mixed 512: 63 decodes x 400 + a 449-token chunk over 749": [(1, 400)] * 63 + [(449, 749)],
    "mixed 256: 15 decodes x 600 + a 241-token chunk over 777": [(1, 600)] * 15 + [(241, 777)],
    "prefill 512: one chunk over 512": [(512, 512)],
    "decode 1 x 64": [(1, 64)],  # short decodes, where the weights' bytes set the step (issue 38)
    "decode 16 x 64": [(1, 64)] * 16,
}


def step_inputs(requests: list[tuple[int, int]]):
    num_tokens = sum(q for q, _ in requests)
    per_req = -(-max(s for _, s in requests) // BLOCK)
    block_tables = np.zeros((len(requests), per_req), np.int32)
    query_start_loc = np.zeros(len(requests) + 1, np.int32)
    positions, slots = [], []
    for r, (q_len, seq_len) in enumerate(requests):
        blocks = 1 + r * per_req + np.arange(-(-seq_len // BLOCK))
        block_tables[r, : len(blocks)] = blocks
        query_start_loc[r + 1] = query_start_loc[r] + q_len
        pos = np.arange(seq_len - q_len, seq_len)
        positions.append(pos)
        slots.append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
    metadata = AttentionMetadata(
        jnp.asarray(np.concatenate(slots), jnp.int32), jnp.asarray(query_start_loc),
        jnp.array([s for _, s in requests], jnp.int32), jnp.asarray(block_tables),
    )
    token_ids = jnp.asarray(np.random.default_rng(0).integers(0, 49152, num_tokens), jnp.int32)
    return token_ids, jnp.asarray(np.concatenate(positions), jnp.int32), metadata, len(requests) * per_req + 1


def op_kind(name: str, targets: dict[str, str]) -> str:
    """An op's kind: a custom call by its target (`targets`: op name -> the C++ kernel, read from the compiled
    HLO), else the op's own kind."""
    if name in targets:
        return targets[name]
    if "Cbjax" in name or "custom-call" in name or "custom_call" in name:
        return "C++ custom call"
    for kind in ("dot", "fusion", "convert", "copy", "gather", "concatenate", "broadcast", "reduce", "transpose"):
        if re.match(kind, name):
            return kind
    return re.sub(r"[.\d]+$", "", name)


def custom_call_targets(compiled_text: str) -> dict[str, str]:
    """Each custom call's op name -> its C++ kernel (the FFI target less its build hash), from compiled HLO text."""
    return dict(re.findall(r"%([\w.]+) = .*? custom-call\(.*?custom_call_target=\"(\w+?)_[0-9a-f]{16}\"", compiled_text))


def profile(fn, label: str, targets: dict[str, str]) -> dict[str, float]:
    """XLA:CPU op time by kind (ms, one call), from a jax.profiler trace."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready(fn())
        (path,) = pathlib.Path(tmp).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(path))
    totals: dict[str, float] = collections.defaultdict(float)
    names: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                name = event.name
                if name.startswith(("Thunk", "ThunkExecutor", "PjRt", "Execute", "$")) or "::" in name:
                    continue
                totals[op_kind(name, targets)] += event.duration_ns / 1e6
                names[name] += event.duration_ns / 1e6
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    print(f"  {label}: top ops " + ", ".join(f"{n} {t:.2f}" for n, t in top))
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--dtype", default="bfloat16", help="the weights' dtype (activations are float32)")
    parser.add_argument("--packed", action="store_true", help="projections packed for the C++ matmul, as the engine packs them")
    parser.add_argument("--result-json")
    args = parser.parse_args()
    if args.packed:
        from kernels_cpu import kernel_problem

        assert kernel_problem() is None, kernel_problem()
    # A GGUF file: its as-stored directory, as LLM(model="file.gguf") serves it.
    model, config = load_model(resolve_model(args.model), args.dtype, "float32", pack_for_cpu=args.packed)
    graphdef, state = nnx.split(model)
    weights, treedef = jax.tree_util.tree_flatten(state)
    results = {}
    for case in args.cases:
        requests = CASES[case]
        token_ids, positions, metadata, num_blocks = step_inputs(requests)
        logits_rows = jnp.asarray(np.asarray(metadata.query_start_loc[1:]) - 1)
        decode_only = all(q == 1 for q, _ in requests)
        plan = AttentionPlan("cpp", decode_only, 8)

        @functools.partial(jax.jit, donate_argnums=1)  # the engine donates its pool: no copy of it per step
        def step(weights, kv_pool):
            m = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, weights))
            hidden, kv_pool = m.hidden_states(token_ids, positions, kv_pool, metadata, plan)
            return m.compute_logits(hidden[logits_rows], plan), kv_pool

        pool = [init_kv_pool(config, num_blocks, BLOCK, jnp.float16)]
        # Compiled once: its HLO text names the custom calls the trace below shows.
        compiled = step.lower(weights, pool[0]).compile()

        def run():  # each call writes its step's KV into the pool the last one returned, as the engine's steps do
            logits, pool[0] = compiled(weights, pool[0])
            return logits

        jax.block_until_ready(run())
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(run())
            times.append((time.perf_counter() - start) * 1e3)
        targets = custom_call_targets(compiled.as_text())
        by_kind = profile(run, case, targets)
        results[case] = {"step_ms_median": float(np.median(times)), "profiled_ms_by_op_kind": by_kind}
        print(f"{case}: step {np.median(times):.1f} ms; " + ", ".join(f"{k} {v:.1f}" for k, v in list(by_kind.items())[:8]))
        del pool
    write_json(args.result_json, results)


if __name__ == "__main__":
    main()
