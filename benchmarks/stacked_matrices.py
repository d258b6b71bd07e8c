"""Why weight_stacks.py stacks vectors only: a chain of dots over stacked matrices against the same
matrices as separate arrays, compiled for this machine's XLA and timed side by side.

    PYTHONPATH=. python benchmarks/stacked_matrices.py

--layers [hidden, inner] kernels (--dtype) (SmolLM2's MLP shape by default), each applied in turn to a
[rows, hidden] activation (the product cut back to hidden columns); one program takes them as
--layers arrays, the other as one [layers, hidden, inner] array read by static index. Both are
compiled once and alternated --rounds times per row count; prints, as JSON, each median in ms and
stacked / separate (the median of each round's ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def chain(weights, x):
    hidden = x.shape[1]
    for w in weights:
        x = (x @ w)[:, :hidden]
    return x


def stacked_chain(stack, x):
    return chain([stack[i] for i in range(stack.shape[0])], x)


def timed_ms(run) -> float:
    start = time.perf_counter()
    jax.block_until_ready(run())
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--inner", type=int, default=1536)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16", help="the kernels' and activations' dtype")
    args = p.parse_args()
    key = jax.random.PRNGKey(0)
    separate = [jax.random.normal(jax.random.fold_in(key, i), (args.hidden, args.inner), args.dtype) / args.hidden**0.5
                for i in range(args.layers)]
    stack = jnp.stack(separate)
    result = {}
    for rows in args.rows:
        x = jnp.ones((rows, args.hidden), args.dtype)
        programs = {"separate": (jax.jit(chain).lower(separate, x).compile(), separate),
                    "stacked": (jax.jit(stacked_chain).lower(stack, x).compile(), stack)}
        same = np.array_equal(*(np.asarray(program(weights, x), np.float32) for program, weights in programs.values()))
        times: dict[str, list[float]] = {name: [] for name in programs}
        for round_index in range(args.rounds):
            for name in (programs if round_index % 2 == 0 else reversed(list(programs))):
                program, weights = programs[name]
                times[name].append(timed_ms(lambda program=program, weights=weights: program(weights, x)))
        result[rows] = {
            "median_ms": {name: round(statistics.median(ts), 2) for name, ts in times.items()},
            "stacked_over_separate": round(statistics.median(a / b for a, b in zip(times["stacked"], times["separate"])), 3),
            "same_values": same,
        }
    print(json.dumps({"dtype": args.dtype, "layers": args.layers, "hidden": args.hidden, "inner": args.inner, "by_rows": result}, indent=1))


if __name__ == "__main__":
    main()
