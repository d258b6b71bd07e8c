"""Would fusing q/k/v into one dot and gate/up into one dot speed up SmolLM2's projections on XLA:CPU?

    PYTHONPATH=. python benchmarks/fused_projections_ab.py --result-json bench_results/fused_projections_ab.json

The projections of 30 SmolLM2-shaped layers (hidden 576, q 576, k/v 192 each, MLP 1536; bf16
weights, float32 activations cast to bf16 for each dot, float32 accumulation, as the engine's
`dtype="bfloat16"`) at several row counts, split (7 dots a layer) against fused (5 dots a layer,
the fused outputs sliced), compiled alone, alternated over --rounds; medians of --repeats calls of
wall time and of this process's CPU time (stable while other jobs share the cores).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cpu_kernel_ab import timed

LAYERS, HIDDEN, Q, KV, INNER = 30, 576, 576, 192, 1536


def dot(x, w):
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)


def split_layers(x, layers):
    for p in layers:
        q, k, v = dot(x, p["q"]), dot(x, p["k"]), dot(x, p["v"])
        x = x + dot(q + jnp.pad(k + v, ((0, 0), (0, Q - KV))), p["o"])  # stands in for attention
        x = x + dot(jax.nn.silu(dot(x, p["gate"])) * dot(x, p["up"]), p["down"])
    return x


def fused_layers(x, layers):
    for p in layers:
        qkv = dot(x, p["qkv"])
        q, k, v = qkv[:, :Q], qkv[:, Q : Q + KV], qkv[:, Q + KV :]
        x = x + dot(q + jnp.pad(k + v, ((0, 0), (0, Q - KV))), p["o"])
        gate_up = dot(x, p["gate_up"])
        x = x + dot(jax.nn.silu(gate_up[:, :INNER]) * gate_up[:, INNER:], p["down"])
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 512])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--result-json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    weight = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.bfloat16)  # noqa: E731
    split = [dict(q=weight(HIDDEN, Q), k=weight(HIDDEN, KV), v=weight(HIDDEN, KV), o=weight(Q, HIDDEN),
                  gate=weight(HIDDEN, INNER), up=weight(HIDDEN, INNER), down=weight(INNER, HIDDEN)) for _ in range(LAYERS)]
    fused = [dict(qkv=jnp.concatenate([p["q"], p["k"], p["v"]], 1), gate_up=jnp.concatenate([p["gate"], p["up"]], 1),
                  o=p["o"], down=p["down"]) for p in split]
    variants = {"split": (jax.jit(split_layers), split), "fused": (jax.jit(fused_layers), fused)}
    results = {}
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN)), jnp.float32)
        times = {name: [] for name in variants}
        for round_index in range(args.rounds):
            for name in (("split", "fused") if round_index % 2 == 0 else ("fused", "split")):
                fn, layers = variants[name]
                jax.block_until_ready(fn(x, layers))  # compiled and warm before timing
                times[name].append(timed(lambda: fn(x, layers), args.repeats))
        wall = {n: float(np.median([t[0] for t in ts])) for n, ts in times.items()}
        cpu = {n: float(np.median([t[1] for t in ts])) for n, ts in times.items()}
        results[rows] = {"wall_ms": wall, "cpu_ms": cpu, "cpu_fused_over_split": cpu["fused"] / cpu["split"]}
        print(f"{rows} rows: cpu split {cpu['split']:.1f} fused {cpu['fused']:.1f} ms "
              f"({cpu['fused'] / cpu['split']:.3f}x); wall split {wall['split']:.1f} fused {wall['fused']:.1f} ms", flush=True)
    if args.result_json:
        pathlib.Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.result_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
