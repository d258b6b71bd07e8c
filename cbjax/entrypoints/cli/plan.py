"""`cbjax plan`: the capacity planner's flags and output."""

from __future__ import annotations

import argparse
import sys


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from cbjax.config import KV_CACHE_DTYPES
    from cbjax.plan.accelerators import ACCELERATORS
    from cbjax.quantization import QUANTIZATIONS

    p = sub.add_parser("plan", help="weights, KV capacity and a decode roofline per device under tensor parallelism")
    p.add_argument("--config", required=True, help="a preset (e.g. llama-3-70b), a config.json, a model directory or a "
                   "GGUF file (its weights counted as served: quantized tensors as stored; an fp8 checkpoint's "
                   "directory likewise)")
    p.add_argument("--device", required=True, choices=list(ACCELERATORS))
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts: whole experts per device (num_experts / N each), not each expert split")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the engine's, min(model's limit, 2048)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                   help="the decoder projections' weight-only quantization, as the engine stores it (default: none)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization and one device: the LM head (a tied model's embedding) quantized too")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--context-len", type=int, default=None, help="context of every sequence in the roofline (default max_model_len)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> None:
    from cbjax.checkpoint.fp8_checkpoint import serves_as_stored
    from cbjax.plan.accelerators import accelerator
    from cbjax.plan.capacity import format_plan, load_model_config, plan_capacity

    try:
        name, config = load_model_config(args.config)
        plan = plan_capacity(
            name, config, accelerator(args.device), args.tensor_parallel_size, max_model_len=args.max_model_len,
            dtype=args.dtype, kv_cache_dtype_name=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
            block_size=args.block_size, context_len=args.context_len, expert_parallel=args.enable_expert_parallel,
            quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
            gguf=args.config if args.config.endswith(".gguf") else None, fp8=args.config if serves_as_stored(args.config) else None,
        )
    except ValueError as error:
        sys.exit(f"cbjax plan: {error}")
    print(format_plan(plan))
