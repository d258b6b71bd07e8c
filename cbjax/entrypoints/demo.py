"""The README's main job: answer a batch of varied prompts with continuous batching.

    python -m cbjax.entrypoints.demo --model downloads/SmolLM2-135M-Instruct.Q4_1.gguf

The built-in model's GGUF file is served as stored (4-bit projections); a converted checkpoint
(`--model checkpoints/smollm2-135m-instruct`, scripts/fetch_model.sh) serves the float32 weights.
"""

from __future__ import annotations

import argparse
import json
import time

from cbjax import LLM, SamplingParams
from cbjax.entrypoints.llm import chat_prompt

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Explain what a neural network is in two sentences.",
    "What is 12 times 7?",
    "Name three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Suggest a name for a black cat.",
    "What does a compiler do?",
    "Write a short poem about autumn leaves.",
    "List four planets of the solar system.",
    "How do I boil an egg?",
    "What is the opposite of 'ancient'?",
    "Describe a rainbow to a child.",
    "What is photosynthesis? Answer briefly.",
    "Give an example of a prime number greater than 50.",
    "Summarize the story of Cinderella in one sentence.",
    "What are the benefits of reading books?",
    "Tell me a fun fact about octopuses.",
]
PLAIN_PROMPTS = [
    "Once upon a time",
    "The three most important inventions of the last century are",
    "def fibonacci(n):",
    "The recipe for a simple tomato soup:",
    "In 1969, astronauts",
    "A good way to learn a new language is",
    "The quick brown fox",
    "Dear hiring manager,",
    "The main difference between a cat and a dog is",
    "Here is a list of fruits: apple, banana,",
    "Water boils at",
    "The city of Paris is famous for",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="downloads/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--compilation-cache-dir", default="auto")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        compilation_cache_dir=args.compilation_cache_dir,
    )
    startup = time.perf_counter() - start
    # Different lengths on purpose: short answers leave early and waiting prompts take their slots.
    chat_params = [SamplingParams(temperature=0.0, max_tokens=32 + 16 * (i % 5)) for i in range(len(CHAT_QUESTIONS))]
    plain_params = [
        SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=24 + 8 * (i % 4)) for i in range(len(PLAIN_PROMPTS))
    ]

    start = time.perf_counter()
    # Chat and plain prompts in one batch (LLM.chat would run the chats as a batch of their own).
    # The question stands as the printed prompt, not the whole rendered template.
    chats = [chat_prompt(llm.get_tokenizer(), [{"role": "user", "content": q}]) | {"prompt": q} for q in CHAT_QUESTIONS]
    outputs = llm.generate(chats + PLAIN_PROMPTS, chat_params + plain_params)
    elapsed = time.perf_counter() - start

    for output in outputs:
        completion = output.outputs[0]
        print(f"### {output.prompt!r}\n{completion.text.strip()}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]\n")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    summary = {
        "requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 2),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / elapsed, 1),
        "startup_s": round(startup, 1),
        "engine": llm.get_stats(),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
