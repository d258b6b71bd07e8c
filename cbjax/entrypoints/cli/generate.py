"""`cbjax generate`: one prompt, its tokens streamed as they come."""

from __future__ import annotations

import argparse
import sys

from cbjax.entrypoints.cli.args import add_engine_args, engine_options


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


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
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
