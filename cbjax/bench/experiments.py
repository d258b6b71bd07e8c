"""Experiments, one command each: `cbjax bench prefill-stall` and `cbjax bench kv-capacity`.

(Continuous vs static is `cbjax bench throughput --scheduling continuous static`.)

- prefill-stall: running decodes while long prompts arrive, chunked prefill against
  whole-prompt prefill, two engines side by side in one process, runs interleaved.
  The decodes' ITL (max, p99) is what a stalled step shows up in.
- kv-capacity: requests that fit at once in a fixed KV memory, paged against
  contiguous max_model_len preallocation. Paged is the engine's own Scheduler and
  BlockManager driven without the model (every step "samples" a dummy token), so the
  count follows the engine's real block accounting and admission policy; contiguous
  is floor(pool tokens / max_model_len), what reserving max_model_len slots per
  request allows.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np

from cbjax.bench.common import (
    fmt, add_dataset_args, add_output_args, build_engine, environment, print_table, serve_once, warm_up, write_json,
)
from cbjax.entrypoints.cli.args import add_engine_args


# ---- prefill-stall -------------------------------------------------------------------


def stall_workload(args: argparse.Namespace, vocab_size: int):
    """Short requests all sent at 0 (they decode), long prompts sent every --long-interval s from then on."""
    from cbjax.bench.dataset import SyntheticRequest

    rng = np.random.default_rng(args.dataset_seed)
    short = [
        SyntheticRequest(rng.integers(0, vocab_size, args.short_input_len).tolist(), args.short_output_len)
        for _ in range(args.num_short)
    ]
    long = [
        SyntheticRequest(rng.integers(0, vocab_size, args.long_input_len).tolist(), args.long_output_len)
        for _ in range(args.num_long)
    ]
    offsets = [0.0] * len(short) + [args.long_interval * (i + 1) for i in range(len(long))]
    return short + long, offsets


def cmd_prefill_stall(args: argparse.Namespace) -> None:
    from cbjax.bench.recorder import StepRecorder

    if args.max_num_seqs <= args.num_short:
        raise SystemExit(
            f"--max-num-seqs {args.max_num_seqs} must exceed --num-short {args.num_short}, or the long prompts "
            "wait for a free seat instead of arriving among running decodes; raise it"
        )
    max_model_len = args.max_model_len or 1024
    variants = {
        "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=args.chunk_size, max_model_len=max_model_len),
        "unchunked": dict(enable_chunked_prefill=False, max_num_batched_tokens=max_model_len, max_model_len=max_model_len),
    }
    recorders = {name: StepRecorder(build_engine(args, **options)) for name, options in variants.items()}
    for recorder in recorders.values():
        warm_up(recorder)
    requests, offsets = stall_workload(args, next(iter(recorders.values())).engine.model_config.vocab_size)
    num_short = args.num_short
    runs = []
    for repeat in range(args.repeats):
        for name, recorder in recorders.items():
            result, timelines = serve_once(recorder, requests, offsets, None, [99.0], {}, f"{name}{repeat}")
            # ITLs of the short requests only: the running decodes that a long prefill may stall.
            decode_itls = [1000 * x for t in timelines[:num_short] for x in t.itls]
            row = {
                "variant": name,
                "repeat": repeat,
                "decode_max_itl_ms": max(decode_itls),
                "decode_p99_itl_ms": float(np.percentile(decode_itls, 99)),
                "decode_median_itl_ms": float(np.median(decode_itls)),
                "long_mean_ttft_ms": statistics.mean(result["latencies_ms"]["ttft"][num_short:]),
                "max_step_ms": max(result["steps"]["duration_ms"]),
                "output_throughput": result["output_throughput"],
                "duration": result["duration"],
            }
            runs.append(row)
            print_table([row], list(row))
    keys = [k for k in runs[0] if k not in ("variant", "repeat")]
    medians = {
        name: {k: statistics.median(r[k] for r in runs if r["variant"] == name) for k in keys} for name in variants
    }
    print(f"\nmedians over {args.repeats} interleaved repeat(s):")
    print_table([{"variant": n, **m} for n, m in medians.items()], ["variant", *keys])
    ratio = medians["unchunked"]["decode_max_itl_ms"] / medians["chunked"]["decode_max_itl_ms"]
    print(f"unchunked / chunked max decode ITL: {ratio:.2f}x")
    write_json(args.result_json, {"medians": medians, "runs": runs, **environment(args)})


# ---- kv-capacity ---------------------------------------------------------------------


def simulate_paged(requests, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                   max_num_batched_tokens: int) -> dict[str, Any]:
    """Run the engine's Scheduler + BlockManager over `requests` (all queued at once) without a model."""
    from cbjax.core.kv.block_manager import BlockManager
    from cbjax.core.request import Request
    from cbjax.core.sched.scheduler import Scheduler
    from cbjax.sampling_params import SamplingParams

    blocks = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len, blocks)
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
        scheduler.add_request(Request(f"sim-{i}", r.prompt_token_ids, params))
    running, waste = [], []
    full_running, full_waste = [], []  # steps with a non-empty queue: the pool, not demand, limits the batch
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        allocated = sum(len(r.block_ids) for r in scheduler.running) * block_size
        holding = sum(r.num_computed_tokens for r in scheduler.running)  # counted when scheduled
        running.append(len(scheduler.running))
        waste.append(1 - holding / allocated if allocated else 0.0)
        if scheduler.num_waiting:
            full_running.append(running[-1])
            full_waste.append(waste[-1])
        scheduler.update(out, [3 for row in out.scheduled if row.samples])
    return {
        "paged_max_concurrent": max(running),
        "paged_median_concurrent_while_queue_nonempty": float(np.median(full_running or [0])),
        "paged_kv_waste_steady_state": float(np.mean(full_waste)) if full_waste else 0.0,
        "paged_kv_waste_all_steps": float(np.mean(waste)),
        "paged_preemptions": scheduler.num_preemptions,
        "simulated_steps": len(running),
    }


def cmd_kv_capacity(args: argparse.Namespace) -> None:
    import jax.numpy as jnp

    from cbjax.bench.dataset import random_requests
    from cbjax.models.config import ModelConfig
    from cbjax.models.registry import kv_cache_bytes_per_block

    config = ModelConfig.from_dir(args.model)
    dtype = "float32" if args.dtype == "auto" else args.dtype
    max_model_len = args.max_model_len or 2048
    bytes_per_block = kv_cache_bytes_per_block(config, args.block_size, jnp.dtype(dtype))
    num_blocks = args.kv_memory_mib * 2**20 // bytes_per_block  # the null block included, as in the engine
    usable_tokens = (num_blocks - 1) * args.block_size
    requests = random_requests(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, config.vocab_size, args.dataset_seed
    )
    contiguous = usable_tokens // max_model_len
    result = {
        "kv_memory_mib": args.kv_memory_mib,
        "dtype": dtype,
        "bytes_per_block": bytes_per_block,
        "num_blocks": int(num_blocks),
        "pool_tokens": usable_tokens,
        "max_model_len": max_model_len,
        "mean_request_len": float(np.mean([r.prompt_len + r.output_len for r in requests])),
        "contiguous_max_concurrent": contiguous,
        **simulate_paged(requests, int(num_blocks), args.block_size, max_model_len, args.max_num_seqs,
                         args.max_num_batched_tokens or 512),
    }
    result["paged_over_contiguous"] = result["paged_max_concurrent"] / max(contiguous, 1)
    for key, value in result.items():
        print(f"{key:<48} {fmt(value)}")
    write_json(args.result_json, result | environment(args))


def add_experiment_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill-stall", help="decode ITL while long prompts arrive: chunked vs whole-prompt prefill")
    add_engine_args(p)
    p.add_argument("--chunk-size", type=int, default=64, help="max_num_batched_tokens of the chunked engine")
    p.add_argument("--num-short", type=int, default=8)
    p.add_argument("--short-input-len", type=int, default=32)
    p.add_argument("--short-output-len", type=int, default=96)
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--long-input-len", type=int, default=896)
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--long-interval", type=float, default=0.5, help="seconds between long prompts")
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    add_output_args(p)
    p.set_defaults(func=cmd_prefill_stall)

    p = sub.add_parser("kv-capacity", help="requests that fit in a fixed KV memory: paged vs contiguous")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-memory-mib", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=1024, help="seat limit of the simulated paged engine")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    add_dataset_args(p)
    add_output_args(p)
    p.set_defaults(func=cmd_kv_capacity)
