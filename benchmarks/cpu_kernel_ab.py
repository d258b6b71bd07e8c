"""Two builds of the C++ attention kernel side by side in one process: a git revision's source against the working tree's
(or --source's).

    PYTHONPATH=. python benchmarks/cpu_kernel_ab.py --base HEAD --result-json bench_results/cpu_kernel_ab.json

Both sources are compiled with kernels_cpu/build.py's flags into a temporary folder and registered
under their own FFI names; each case (one layer of SmolLM2's attention: 9 query heads, 3 KV heads,
head_dim 64, block 16, float16 pool, every request on its own pages, scattered over the pool) runs A and B alternately for
--rounds rounds of --repeats calls. Reported per case: medians of wall time and of this process's
CPU time (both threads; stable when other jobs share the cores, where wall time is not), their
B/A ratios, and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import cbjax  # noqa: F401 - imports kernels_cpu in the order its package expects
from kernels_cpu.build import FLAGS, SOURCES, compiler

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16

# name -> [(new tokens, context length after them)] per request
CASES = {
    "decode 16 x 100": [(1, 100)] * 16,
    "decode 16 x 600": [(1, 600)] * 16,
    "decode 64 x 500": [(1, 500)] * 64,
    "mixed: 63 decodes x 400 + a 449-token chunk over 749": [(1, 400)] * 63 + [(449, 749)],
    "mixed: 15 decodes x 600 + a 241-token chunk over 777": [(1, 600)] * 15 + [(241, 777)],
    "prefill: a 32-token question over a 544 prefix": [(32, 544)],
    "prefill: one 512-token prompt": [(512, 512)],
    "mixed: 15 decodes x 100 + a 17-token chunk": [(1, 100)] * 15 + [(17, 17)],
}


def build(source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    command = [compiler(), *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(out)]
    subprocess.run(command, check=True, capture_output=True)
    return out


def register(library_path: pathlib.Path, name: str) -> str:
    library = ctypes.cdll.LoadLibrary(str(library_path))
    target = f"CbjaxPagedAttentionF16_{name}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(library.CbjaxPagedAttentionF16), platform="cpu")
    return target


def case_inputs(requests: list[tuple[int, int]]):
    num_tokens = sum(q for q, _ in requests)
    per_req = -(-max(s for _, s in requests) // BLOCK)
    block_tables = np.zeros((len(requests), per_req), np.int32)
    query_start = np.zeros(len(requests) + 1, np.int32)
    rng = np.random.default_rng(0)
    pages = 1 + rng.permutation(len(requests) * per_req)  # scattered over the pool, as a serving engine's are
    for r, (q_len, seq_len) in enumerate(requests):
        block_tables[r, : -(-seq_len // BLOCK)] = pages[r * per_req : r * per_req + -(-seq_len // BLOCK)]
        query_start[r + 1] = query_start[r] + q_len
    pool_shape = (KV_HEADS, len(requests) * per_req + 1, BLOCK, DIM)
    k_pages = jnp.asarray(rng.standard_normal(pool_shape), jnp.float16)
    v_pages = jnp.asarray(rng.standard_normal(pool_shape), jnp.float16)
    q = jnp.asarray(rng.standard_normal((num_tokens, HEADS, DIM)), jnp.float32)
    seq_lens = np.array([s for _, s in requests], np.int32)
    return q, k_pages, v_pages, jnp.asarray(query_start), jnp.asarray(seq_lens), jnp.asarray(block_tables)


def timed(fn, repeats: int) -> tuple[float, float]:
    """Medians of wall and process CPU ms over `repeats` calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn())
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return float(np.median(walls)) * 1e3, float(np.median(cpus)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD", help="git revision of variant A's source")
    parser.add_argument("--source", default=str(SOURCES[0]), help="variant B's source (default: the working tree's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--result-json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        base_source = tmp / "base.cc"
        base_source.write_text(subprocess.run(
            ["git", "show", f"{args.base}:kernels_cpu/paged_attention.cc"], capture_output=True, text=True, check=True
        ).stdout)
        targets = {"A": register(build(base_source, tmp / "a.so"), "A"), "B": register(build(pathlib.Path(args.source), tmp / "b.so"), "B")}
    results = {}
    for case in args.cases:
        q, k_pages, v_pages, query_start, seq_lens, block_tables = case_inputs(CASES[case])
        calls = {
            variant: jax.jit(lambda *xs, target=target: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
                *xs, sm_scale=np.float32(DIM**-0.5)))
            for variant, target in targets.items()
        }
        inputs = (q, k_pages, v_pages, query_start, seq_lens, block_tables)
        outs = {v: np.asarray(call(*inputs)) for v, call in calls.items()}
        times = {v: [] for v in calls}
        for round_index in range(args.rounds):
            for variant in (("A", "B") if round_index % 2 == 0 else ("B", "A")):
                times[variant].append(timed(lambda: calls[variant](*inputs), args.repeats))
        wall = {v: float(np.median([t[0] for t in ts])) for v, ts in times.items()}
        cpu = {v: float(np.median([t[1] for t in ts])) for v, ts in times.items()}
        results[case] = {
            "wall_ms": wall, "cpu_ms": cpu, "wall_B_over_A": wall["B"] / wall["A"], "cpu_B_over_A": cpu["B"] / cpu["A"],
            "max_abs_diff": float(np.max(np.abs(outs["A"] - outs["B"]))),
        }
        print(f"{case}: wall A {wall['A']:.3f} B {wall['B']:.3f} ms ({wall['B'] / wall['A']:.2f}x); "
              f"cpu A {cpu['A']:.3f} B {cpu['B']:.3f} ms ({cpu['B'] / cpu['A']:.2f}x); "
              f"max |A - B| {results[case]['max_abs_diff']:.2e}", flush=True)
    if args.result_json:
        pathlib.Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.result_json).write_text(json.dumps({"base": args.base, "cases": results}, indent=2))


if __name__ == "__main__":
    main()
