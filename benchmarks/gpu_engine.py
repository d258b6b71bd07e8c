"""Engine decode steps on Llama-3-8B-shaped random weights against the bandwidth floor.

    PYTHONPATH=. python -m benchmarks.gpu_engine --out engine_gpu.json

For each batch size, one decode step of the real runner (compiled step, Pallas
kernels, on-device sampling) at a given context length, timed as the median of
repeats after a warm-up. The floor is (weight bytes + K/V bytes read) / the
device-to-device copy bandwidth measured in the same run; the ratio floor/time
says how close the step is to memory-bound. `--dry-run` runs a tiny config on
CPU with the jnp attention, to check the script where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.kernels import copy_bandwidth
from cbjax.models.config import ModelConfig, RopeScaling
from cbjax.worker.compilation.buckets import pick_bucket
from cbjax.config import EngineConfig
from cbjax.core.request import Request
from cbjax.worker.model_runner import ModelRunner
from cbjax.core.sched.output import ScheduledRequest, SchedulerOutput
from cbjax.models.llama import LlamaForCausalLM
from cbjax.sampling_params import SamplingParams

LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
)


def model_config(shape: dict, dtype: str) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=RopeScaling(),
        tie_word_embeddings=False, attention_bias=False, attention_out_bias=False, mlp_bias=False, qk_norm=False,
        dtype=dtype, bos_token_id=1, eos_token_id=(2,), **shape,
    )


def decode_batch(num_reqs: int, context: int, block_size: int) -> SchedulerOutput:
    """num_reqs requests, each with `context` tokens computed, decoding their next token."""
    blocks_per_req = -(-(context + 1) // block_size)
    rows = []
    for r in range(num_reqs):
        request = Request(f"r{r}", list(np.arange(context) % 1000 + 3), SamplingParams(temperature=0.0, max_tokens=8))
        request.append_output_token(7)
        request.num_computed_tokens = context
        request.block_ids = list(1 + r * blocks_per_req + np.arange(blocks_per_req))
        rows.append(ScheduledRequest(request, num_new_tokens=1, start=context, samples=True))
    return SchedulerOutput(scheduled=rows, preempted_request_ids=[])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("engine_gpu.json"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="tiny config on CPU, jnp attention")
    args = parser.parse_args(argv)

    dtype = "float32" if args.dry_run else "bfloat16"
    config = model_config(TINY if args.dry_run else LLAMA3_8B, dtype)
    block_size, max_seqs = 16, max(args.batches)
    max_model_len = args.context + 16
    engine_config = EngineConfig(
        model="<random>", dtype=dtype, max_num_seqs=max_seqs, max_model_len=max_model_len, block_size=block_size,
        max_num_batched_tokens=max(max_seqs, 16), attention_backend="xla" if args.dry_run else "pallas",
    )
    engine_config.resolve(config.max_position_embeddings)
    model = LlamaForCausalLM(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model)))
    num_blocks = max_seqs * -(-max_model_len // block_size) + 1
    runner = ModelRunner(model, config, engine_config, num_blocks, engine_config.attention_backend)
    runner.buckets = sorted({pick_bucket(runner.buckets, "decode", b, b) for b in args.batches})
    start = time.perf_counter()
    runner.precompile(progress=True)
    compile_s = time.perf_counter() - start
    copy_gbps = copy_bandwidth(1 << (24 if args.dry_run else 30), repeats=5, inner=3)
    kv_token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * jnp.dtype(dtype).itemsize
    rows = []
    for num_reqs in args.batches:
        scheduled = decode_batch(num_reqs, args.context, block_size)
        runner.execute(scheduled)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            runner.execute(scheduled)  # includes packing and the one result transfer, as when serving
            times.append(time.perf_counter() - t0)
        step_s = float(np.median(times))
        bytes_read = weight_bytes + num_reqs * (args.context + 1) * kv_token_bytes
        floor_s = bytes_read / (copy_gbps * 1e9)
        rows.append(dict(batch=num_reqs, context=args.context, step_ms=step_s * 1e3, floor_ms=floor_s * 1e3,
                         floor_over_step=floor_s / step_s, tokens_per_s=num_reqs / step_s))
        print(f"batch {num_reqs:4d}  step {step_s * 1e3:8.2f} ms  floor {floor_s * 1e3:8.2f} ms  "
              f"floor/step {floor_s / step_s:5.2f}  {num_reqs / step_s:9.1f} tok/s")
    report = dict(device=str(jax.devices()[0]), dtype=dtype, weight_bytes=weight_bytes, copy_gbps=copy_gbps,
                  compile_s=compile_s, backend=engine_config.attention_backend, rows=rows)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
