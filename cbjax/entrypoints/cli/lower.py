"""`cbjax lower`: lower every bucketed step for another platform (CUDA by default), no device needed.

From a checkpoint (`--model`: the weights are loaded, then abstracted), or from a model's config
alone (`--config`: a preset such as llama-3-70b, a config.json or a model directory; abstract
weights, nothing allocated), with `--tensor-parallel-size N` over N virtual CPU devices.
"""

from __future__ import annotations

import argparse
import os
import sys

from cbjax.entrypoints.cli.args import add_engine_args, engine_options


def add_lower_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lower", help="lower every bucketed step for another platform (no device needed)")
    add_engine_args(p, model_required=False)
    p.add_argument("--config", default=None,
                   help="lower from a model's config alone (a preset, a config.json or a directory): abstract weights")
    p.add_argument("--platform", default="cuda")
    p.add_argument("--backend", default="pallas", choices=["pallas", "xla"])
    p.set_defaults(func=cmd_lower)


def cmd_lower(args: argparse.Namespace) -> None:
    if (args.model is None) == (args.config is None):
        sys.exit("cbjax lower: give either --model CHECKPOINT or --config PRESET_OR_CONFIG_JSON")
    if args.config is not None and args.tensor_parallel_size > 1:
        # The mesh is made of virtual CPU devices; XLA reads this flag when jax first starts its CPU backend.
        flag = f"--xla_force_host_platform_device_count={args.tensor_parallel_size}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    results = _lower_config(args) if args.config is not None else _lower_checkpoint(args)
    failed = [(bucket, error) for bucket, error in results if error is not None]
    print(f"lowered {len(results) - len(failed)}/{len(results)} steps for {args.platform} with backend {args.backend}"
          f" at tensor_parallel_size={args.tensor_parallel_size}{' with expert parallelism' if args.enable_expert_parallel else ''}")
    for bucket, error in failed:
        print(f"FAILED {bucket.kind} tokens={bucket.num_tokens} requests={bucket.num_reqs}: {error}", file=sys.stderr)
    if failed:
        sys.exit(1)


def _lower_checkpoint(args: argparse.Namespace) -> list:
    from cbjax.config import EngineConfig
    from cbjax.engine.llm_engine import LLMEngine

    options = engine_options(args) | {"attention_backend": "xla"}
    engine = LLMEngine(EngineConfig(model=args.model, **options), precompile=False)
    return engine.runner.lower_all(args.platform, backend=args.backend)


def _lower_config(args: argparse.Namespace) -> list:
    """Lower every bucket from the config alone, printing each one's partitions and argument shardings."""
    from cbjax.checkpoint.fp8_checkpoint import serves_as_stored
    from cbjax.worker.compilation.abstract_lowering import abstract_runner, argument_shardings, num_partitions
    from cbjax.config import EngineConfig
    from cbjax.plan.capacity import load_model_config

    if args.config.endswith(".gguf") or serves_as_stored(args.config):
        sys.exit(f"cbjax lower: --config {args.config} would lower the float model its config describes, not the "
                 f"checkpoint's quantized tensors; use --model {args.config}, which loads them as stored")
    try:
        name, model_config = load_model_config(args.config)
        runner = abstract_runner(model_config, EngineConfig(model=name, **engine_options(args)), args.platform)
    except ValueError as error:
        sys.exit(f"cbjax lower: {error}")
    results = []
    for bucket in runner.buckets:
        try:
            text = runner.lower_for(bucket, args.platform, args.backend).as_text()
        except Exception as error:  # noqa: BLE001 - reported per bucket
            results.append((bucket, error))
            continue
        results.append((bucket, None))
        shardings = ", ".join(f"{count} x {spec}" for spec, count in argument_shardings(text).most_common())
        print(f"{bucket.kind} tokens={bucket.num_tokens} requests={bucket.num_reqs}: {num_partitions(text)} partitions; "
              f"arguments by sharding: {shardings or 'none'}", flush=True)
    return results
