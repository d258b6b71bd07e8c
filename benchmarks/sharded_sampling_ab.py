"""Sampling under TP: each device's top-64 candidates against gathering the vocabulary rows, side by side.

Both jitted on logits split over N virtual CPU devices' vocabulary slices, called alternately in
one process (round 0 a warm-up), per shape: rows x vocabulary, greedy or seeded top-k 20. On one
CPU the "devices" share its memory, so the gather is a copy, not a transfer between devices: this
measures the sampler's own cost, not what the candidates save in interconnect traffic on GPUs.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/sharded_sampling_ab.py --out bench_results/sharded_sampling.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cbjax.worker.sample.penalty_state import init_penalty_state
from cbjax.worker.sample.sampler import SamplingRow, build_sampling_tensors, sample
from cbjax.worker.sample.sharded import sample_vocab_sharded
from cbjax.sampling_params import SamplingParams
from cbjax.models.layers.mesh import MODEL_AXIS


def time_ms(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) * 1e3


def compare(mesh: Mesh, num_rows: int, vocab: int, params: SamplingParams, rounds: int, calls: int) -> dict:
    logits = jax.device_put(
        3.0 * jax.random.normal(jax.random.key(0), (num_rows, vocab)), NamedSharding(mesh, P(None, MODEL_AXIS))
    )
    rows = [SamplingRow(params, seed=i, counter=0) for i in range(num_rows)]
    t = build_sampling_tensors(rows, num_rows, 16)
    penalty_state = jax.device_put(init_penalty_state(1, vocab), NamedSharding(mesh, P()))
    replicated = NamedSharding(mesh, P())
    gathered = jax.jit(lambda x, t, s: sample(jax.lax.with_sharding_constraint(x, replicated), t, s).token_ids)
    candidates = jax.jit(lambda x, t, s: sample_vocab_sharded(x, t, s, None, mesh).token_ids)
    assert np.array_equal(gathered(logits, t, penalty_state), candidates(logits, t, penalty_state))
    per_round = {"gathered": [], "candidates": []}
    for round_index in range(rounds + 1):
        for name, fn in (("gathered", gathered), ("candidates", candidates)):
            ms = statistics.median(time_ms(fn, logits, t, penalty_state) for _ in range(calls))
            if round_index:
                per_round[name].append(ms)
    medians = {name: statistics.median(v) for name, v in per_round.items()}
    return {
        "rows": num_rows, "vocab": vocab, "sampling": "greedy" if params.greedy else f"top_k={params.top_k}",
        "median_ms": medians, "gathered_over_candidates": medians["gathered"] / medians["candidates"],
        "per_round_ms": per_round,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="calls per round; the round's median counts")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    mesh = Mesh(np.asarray(jax.devices()), (MODEL_AXIS,))
    results = [
        compare(mesh, num_rows, vocab, params, args.rounds, args.calls)
        for vocab in (49152, 128256)
        for num_rows in (16, 64)
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20))
    ]
    for r in results:
        print(f"{r['rows']:>3} rows x {r['vocab']:>6} vocab, {r['sampling']:>8}: gathered {r['median_ms']['gathered']:.2f} ms, "
              f"candidates {r['median_ms']['candidates']:.2f} ms ({r['gathered_over_candidates']:.2f}x)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"devices": len(jax.devices()), "results": results}, indent=1))


if __name__ == "__main__":
    main()
