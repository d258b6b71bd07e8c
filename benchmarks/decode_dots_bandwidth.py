"""How fast XLA:CPU's dots read the weights in a decode step, against how fast the machine streams them.

    PYTHONPATH=. python -m benchmarks.decode_dots_bandwidth --result-json bench_results/decode_dots_bandwidth.json
    taskset -c 0 python -m benchmarks.decode_dots_bandwidth      # the same on one core

A decode step of a small model reads every weight once for a handful of rows: at 8-16 rows it
should run at the machine's memory bandwidth. This times (median of --calls) a jitted sum over an
array the size of SmolLM2-135M's float32 weights (the streaming rate), and the 30 layers of
SmolLM2-shaped projections (q/k/v, o, gate/up, down; float32 or, with --dtype bfloat16, as the
engine's bf16 mode; the weights laid out [in, out] as the model's) at each of --rows, and reports each as GB/s of weights read and GFLOP/s.

With --packed the same projections also run through cbjax's C++ packed-panel matmul
(kernels_cpu/packed_matmul.cc) over the weights packed as the engine packs them, timed
alternately with XLA's dots in this process (`packed_over_xla`: XLA's ms over the kernel's).
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cpu_steps import median_ms
from cbjax.bench.common import print_table, write_json

HIDDEN, INTERMEDIATE, QKV, LAYERS, VOCAB = 576, 1536, 576 + 2 * 192, 30, 49152


def projections(h, layers, dot):
    """30 SmolLM2-shaped layers of projections, each product `dot(x, w)`."""
    for qkv, o, gate_up, down in layers:
        h = h + dot(dot(h, qkv)[:, :HIDDEN], o)
        g = dot(h, gate_up)
        h = h + dot(g[:, :INTERMEDIATE] * g[:, INTERMEDIATE:], down)
    return h


def xla_dot(x, w):
    """As nnx.Linear runs it: inputs in the weights' dtype (bfloat16: cbjax's CPU bf16 mode), sums in float32."""
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--calls", type=int, default=7)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the weights'; bfloat16 as the engine runs it on a CPU: inputs rounded to bfloat16, sums in float32")
    p.add_argument("--packed", action="store_true", help="also time the C++ packed-panel matmul")
    p.add_argument("--rounds", type=int, default=1, help="alternated rounds of XLA and the kernel, with --packed")
    p.add_argument("--tied-head", action="store_true",
                   help="with --packed: also SmolLM2's tied LM head ([49152, 576] table), as compute_logits runs it "
                        "against the kernel over the transposed table packed (float32)")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    key = jax.random.key(0)
    dtype = jnp.dtype(args.dtype)
    layers = [tuple((jax.random.normal(jax.random.fold_in(key, 4 * i + j), shape, jnp.float32) * 0.02).astype(dtype)
                    for j, shape in enumerate([(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]))
              for i in range(LAYERS)]
    weight_bytes = sum(w.nbytes for layer in layers for w in layer)
    num_weights = sum(w.size for layer in layers for w in layer)
    flat = jnp.ones(weight_bytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    rows = [{"what": "sum over the same bytes", "rows": 0,
             "ms": (ms := median_ms(lambda: total(flat), args.calls)), "gb_per_s": weight_bytes / ms / 1e6, "gflop_per_s": None}]
    # what: (jitted step, its weights, the XLA step it is compared with, bytes and number of weights it reads)
    base = "30 layers of projections"
    steps = {base: (jax.jit(functools.partial(projections, dot=xla_dot)), layers, base, weight_bytes, num_weights)}
    if args.packed:
        from kernels_cpu import pack_weight, packed_matmul_cpu

        packed = [tuple(jnp.asarray(pack_weight(np.asarray(w))) for w in layer) for layer in layers]
        steps["the same, C++ packed matmul"] = (
            jax.jit(functools.partial(projections, dot=packed_matmul_cpu)), packed, base, weight_bytes, num_weights)
        if args.tied_head:
            table = (jax.random.normal(jax.random.fold_in(key, 4 * LAYERS), (VOCAB, HIDDEN), jnp.float32) * 0.02).astype(dtype)
            head = "tied LM head"
            if dtype == jnp.float32:  # as compute_logits: the table untransposed, XLA's dot
                steps[head] = (jax.jit(lambda h, table: jnp.dot(table, h.T).T), table, head, table.nbytes, table.size)
            else:  # its transposed bf16 copy (TIED_HEAD_PARTS blocks there, one here), a bf16 x bf16 -> f32 dot
                steps[head] = (jax.jit(lambda h, head_t: jnp.dot(h.astype(dtype), head_t, preferred_element_type=jnp.float32)),
                               table.T, head, table.nbytes, table.size)
            steps["tied LM head, packed matmul"] = (
                jax.jit(packed_matmul_cpu), jnp.asarray(pack_weight(np.asarray(table).T)), head, table.nbytes, table.size)
    for num_rows in args.rows:
        h = jax.random.normal(key, (num_rows, HIDDEN), jnp.float32)
        times = {what: [] for what in steps}
        for _ in range(args.rounds):
            for what, (step, weights, *_) in steps.items():
                times[what].append(median_ms(lambda: step(h, weights), args.calls))
        for what, measured in times.items():
            _, _, baseline, nbytes, count = steps[what]
            ms = statistics.median(measured)
            rows.append({"what": what, "rows": num_rows, "ms": ms, "gb_per_s": nbytes / ms / 1e6,
                         "gflop_per_s": 2 * num_rows * count / ms / 1e6,
                         "packed_over_xla": statistics.median(times[baseline]) / ms if args.packed else None})
    print(f"{weight_bytes / 1e6:.0f} MB of {args.dtype} weights, {jax.devices()[0].platform}")
    print_table(rows, ["what", "rows", "ms", "gb_per_s", "gflop_per_s", "packed_over_xla"])
    write_json(args.result_json, {"weight_bytes": weight_bytes, "rows": rows})


if __name__ == "__main__":
    main()
