"""`cbjax convert | import-gguf | generate | serve | lower | worker | plan | bench`."""

from __future__ import annotations

import argparse
import logging
import sys

from cbjax.entrypoints.cli.bench import add_bench_parser
from cbjax.entrypoints.cli.args import add_engine_args, add_serve_args, engine_options
from cbjax.entrypoints.cli.lower import add_lower_parser
from cbjax.entrypoints.cli.plan import add_plan_parser


def cmd_convert(args: argparse.Namespace) -> None:
    from cbjax.checkpoint.convert import convert_checkpoint

    out = convert_checkpoint(args.hf_dir, args.out, args.dtype)
    print(f"converted {args.hf_dir} -> {out}")


def cmd_import_gguf(args: argparse.Namespace) -> None:
    from cbjax.checkpoint.gguf_import import import_gguf

    out = import_gguf(args.gguf_file, args.out_hf_dir)
    print(f"imported {args.gguf_file} -> {out} (a Hugging Face directory; next: cbjax convert {out})")


def cmd_generate(args: argparse.Namespace) -> None:
    from cbjax.worker.compilation.buckets import one_request_buckets
    from cbjax.config import EngineConfig
    from cbjax.engine.llm_engine import LLMEngine
    from cbjax.entrypoints.llm import chat_prompt
    from cbjax.sampling_params import SamplingParams

    # One prompt of a known length: compile (or load from the cache) and warm up only the steps it runs.
    engine = LLMEngine(EngineConfig(model=args.model, **engine_options(args)), precompile=False)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.sample_seed
    )
    if args.chat is not None:
        prompt = chat_prompt(engine.tokenizer, [{"role": "user", "content": args.chat}])
    else:
        prompt = {"prompt": args.prompt, "prompt_token_ids": engine.tokenizer.encode(args.prompt)}
    engine.add_request("cli", prompt, params)
    runner = engine.runner
    runner.precompile(buckets=one_request_buckets(
        runner.buckets, len(prompt["prompt_token_ids"]), engine.config.max_num_batched_tokens
    ))
    printed = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")


def cmd_serve(args: argparse.Namespace) -> None:
    from cbjax.entrypoints.openai.server import cmd_serve as serve

    serve(args)


def cmd_worker(args: argparse.Namespace) -> None:
    from cbjax.worker.distributed.multihost import run_worker

    run_worker(args.model, engine_options(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbjax", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine decisions (INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="Hugging Face safetensors directory -> checkpoints/NAME (orbax)")
    p.add_argument("hf_dir")
    p.add_argument("--out", default=None, help="output directory (default checkpoints/<name>)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("import-gguf", help="llama GGUF file -> Hugging Face directory (safetensors + tokenizer)")
    p.add_argument("gguf_file")
    p.add_argument("out_hf_dir")
    p.set_defaults(func=cmd_import_gguf)

    p = sub.add_parser("generate", help="generate for one prompt, streaming tokens as they come")
    add_engine_args(p)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt")
    group.add_argument("--chat", help="a user message, rendered with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None)
    # One prompt: a step needs at most 2 rows and 128-token prompt chunks (cmd_generate compiles only the
    # buckets its prompt runs in: 2 for a short prompt).
    p.set_defaults(func=cmd_generate, max_num_seqs=1, max_num_batched_tokens=128)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    add_engine_args(p, model_positional=True, server=True)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    add_lower_parser(sub)

    p = sub.add_parser("worker", help="multi-host: a process > 0 that runs process 0's steps on its own devices")
    add_engine_args(p, server=True)  # the same defaults as `cbjax serve`: every process compiles the same steps
    p.set_defaults(func=cmd_worker)

    add_plan_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()
