"""A/B: `cbjax serve` under N concurrent streaming clients against offline `LLM.generate`, same
requests and engine options, one after the other in one run; prints one JSON object.

    PYTHONPATH=. python benchmarks/server_vs_offline.py --model checkpoints/smollm2-135m-instruct

Also TTFT at low load (one request at a time): server (client-side, first streamed chunk) against
the in-process engine (RequestOutput.metrics: first token - arrival).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_process import ServerProcess  # noqa: E402

from cbjax import LLM, SamplingParams  # noqa: E402

TOPICS = ["the sea", "a red fox", "old maps", "winter trains", "bread", "the moon", "clocks", "gardens"]


def prompts(count: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(count)]


def offline(args) -> dict:
    llm = LLM(args.model, **engine_options(args))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts(2), params, use_tqdm=False)  # warm
    start = time.perf_counter()
    outs = llm.generate(prompts(args.num_requests), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttfts = []
    for prompt in prompts(args.num_ttft):
        (out,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return {"output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
            "ttft_p50_ms": 1000 * statistics.median(ttfts)}


async def served(url: str, args) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    slots = asyncio.Semaphore(args.concurrency)

    async def one(prompt: str, max_tokens: int) -> tuple[int, float]:
        async with slots:
            start, first, tokens = time.perf_counter(), None, 0
            stream = await client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0.0, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and first is None:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens, first - start

    await asyncio.gather(*[one(p, args.max_tokens) for p in prompts(2)])  # warm
    start = time.perf_counter()
    results = await asyncio.gather(*[one(p, args.max_tokens) for p in prompts(args.num_requests)])
    elapsed = time.perf_counter() - start
    ttfts = [(await one(p, 4))[1] for p in prompts(args.num_ttft)]
    return {"output_tok_s": sum(tokens for tokens, _ in results) / elapsed,
            "ttft_p50_ms": 1000 * statistics.median(ttfts)}


def engine_options(args) -> dict:
    return {"max_num_seqs": args.concurrency, "max_model_len": 512, "compilation_cache_dir": args.compile_cache}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-ttft", type=int, default=9)
    parser.add_argument("--compile-cache", default=".jax_cache")
    parser.add_argument("--serve-flags", default="", help='more `cbjax serve` flags, e.g. "--num-reserved-cpus 0"')
    args = parser.parse_args()
    offline_result = offline(args)
    server = ServerProcess(Path(args.model), Path("/tmp/cbjax-bench-serve.log"), "--served-model-name", "bench",
                           "--max-num-seqs", str(args.concurrency), "--max-model-len", "512",
                           "--compilation-cache-dir", args.compile_cache, *args.serve_flags.split())
    try:
        server_result = asyncio.run(served(server.url, args))
    finally:
        server.stop()
    print(json.dumps({
        "serve_flags": args.serve_flags, "concurrency": args.concurrency, "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "offline": offline_result, "server": server_result,
        "server_over_offline_tok_s": server_result["output_tok_s"] / offline_result["output_tok_s"],
        "ttft_p50_delta_ms": server_result["ttft_p50_ms"] - offline_result["ttft_p50_ms"],
    }, indent=2))


if __name__ == "__main__":
    main()
