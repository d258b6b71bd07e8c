"""Engine options as command-line flags (vLLM's names), shared by every serving command."""

from __future__ import annotations

import argparse

from cbjax.config import KV_CACHE_DTYPES
from cbjax.core.kv.prefix_cache import HASH_ALGOS
from cbjax.core.sched.policy import SCHEDULING_POLICIES
from cbjax.quantization import QUANTIZATIONS
from cbjax.entrypoints.openai.reasoning import PARSERS
from cbjax.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS


def add_engine_args(
    parser: argparse.ArgumentParser, model_positional: bool = False, model_required: bool = True, variants: bool = False,
    server: bool = False,
) -> None:
    """The engine options every serving command takes (vLLM's flag names). With `variants` (benchmarks),
    --async-scheduling takes on, off or both, run side by side.

    `server` (`cbjax serve` and its multi-host workers, which must compile the same steps): defaults
    for a long-lived process answering requests as they come, where time to first token counts
    more than start-up. Prompt-bucket midpoints are on, and async scheduling is "auto" (None: on a
    CPU, overlapping only while every seat is taken; LLMEngine._overlaps). Chosen on median TTFT at
    1 req/s against `vllm serve` and the server's throughput (`scripts/bench_serve_side_by_side.sh`,
    `python -m benchmarks.server_vs_offline`; BENCHMARKS.md).
    """
    if model_positional:  # `cbjax serve [MODEL]`, as `vllm serve MODEL`
        parser.add_argument("model", nargs="?", default=None,
                            help="converted checkpoint or Hugging Face directory (default: built-in SmolLM2)")
    else:
        parser.add_argument("--model", required=model_required, help="converted checkpoint directory (cbjax convert)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    parser.add_argument("--calculate-kv-scales", action="store_true",
                        help="with --kv-cache-dtype fp8: each layer's K and V scales from a calibration step at "
                             "start-up (max |K| / 200, max |V| / 100), not the checkpoint's or 1.0")
    parser.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                        help="weight-only quantization of the decoder projections at load (default: none)")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="with --quantization: the LM head (a tied model's embedding) quantized too (default: float)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--max-num-prefills", type=int, default=8, help="most requests computing a prompt chunk in one step"
    )
    parser.add_argument(
        "--scheduling-policy", default="fcfs", choices=sorted(SCHEDULING_POLICIES),
        help="fcfs: arrival order; priority: each request's priority, lower first, ties by arrival "
             "(the largest is preempted first)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="GPU only (default 0.9)")
    parser.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpp", "pallas", "pallas_interpret", "xla"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compilation-cache-dir", default="auto",
        help="persistent compile cache folder; 'auto' = under ~/.cache/cbjax (CBJAX_DISABLE_COMPILE_CACHE=1 turns it off)",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="devices to split the model over (all processes')"
    )
    parser.add_argument(
        "--enable-expert-parallel", action="store_true",
        help="mixture-of-experts: place whole experts on the --tensor-parallel-size devices (num_experts / N each) "
             "instead of splitting every expert over all; attention stays tensor parallel",
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse cached KV blocks of shared prompt prefixes (--no-enable-prefix-caching to turn off)",
    )
    parser.add_argument(
        "--prefix-caching-hash-algo", default="sha256", choices=list(HASH_ALGOS),
        help="the prefix cache's block hash: sha256 (collision-resistant) or builtin (Python's hash: faster, "
             "but a crafted prompt can collide with another's cached prefix; one tenant only)",
    )
    if variants:
        parser.add_argument("--async-scheduling", nargs="+", default=["on"], choices=["on", "off"],
                            help="one or both (both: side by side in one engine, interleaved)")
    else:
        parser.add_argument(
            "--async-scheduling", action=argparse.BooleanOptionalAction, default=None if server else True,
            help="schedule the next step while one runs (--no-async-scheduling: one step at a time); default: "
                 + ("auto: on a CPU only while every seat is taken, always elsewhere" if server else "on"),
        )
    parser.add_argument(
        "--prompt-bucket-midpoints", action=argparse.BooleanOptionalAction, default=server,
        help="also compile prompt steps of 96, 192, 384 tokens (1.5x each power of two from 64): less padding "
             "beside running decodes (lower TTFT when serving), 3 more compiles at start-up; default: "
             + ("on" if server else "off"),
    )
    parser.add_argument(
        "--cpu-packed-weights", action=argparse.BooleanOptionalAction, default=True,
        help="on a CPU: float32 (bfloat16 with AMX) projection weights packed at load for the C++ matmul kernel "
             "(--no-cpu-packed-weights: XLA's dots); default: on",
    )
    parser.add_argument(
        "--speculative-config", default=None,
        help='speculative decoding, as JSON (vLLM\'s form): \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4}\', method "suffix", or \'{"method": "draft_model", "model": DRAFT_DIR, '
             '"num_speculative_tokens": 4}\'; default: off',
    )
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters beside the base model (requests name them; see --lora-modules)")
    parser.add_argument("--max-loras", type=int, default=1, help="LoRA adapters on the device at once (a step mixes this many)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank an adapter may have")
    parser.add_argument("--max-cpu-loras", type=int, default=None, help="LoRA adapters kept read on the host (default: --max-loras)")
    parser.add_argument("--coordinator", default=None, help="multi-host: HOST:PORT of process 0 (the same for all)")
    parser.add_argument("--num-processes", type=int, default=1, help="multi-host: processes in the engine")
    parser.add_argument("--process-id", type=int, default=0, help="multi-host: this process (0 serves)")


def engine_options(args: argparse.Namespace) -> dict:
    names = (
        "dtype kv_cache_dtype calculate_kv_scales quantization quantize_lm_head max_num_seqs max_model_len max_num_batched_tokens max_num_prefills scheduling_policy "
        "block_size num_kv_blocks "
        "kv_cache_memory_bytes "
        "gpu_memory_utilization enable_chunked_prefill attention_backend seed compilation_cache_dir tensor_parallel_size "
        "enable_expert_parallel "
        "enable_prefix_caching prefix_caching_hash_algo async_scheduling prompt_bucket_midpoints cpu_packed_weights speculative_config coordinator num_processes process_id "
        "enable_lora max_loras max_lora_rank max_cpu_loras"
    ).split()
    return {name: getattr(args, name) for name in names}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    parser.add_argument("--api-key", default=None,
                        help="demand 'Authorization: Bearer KEY' on /v1/* (default $CBJAX_API_KEY)")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="answer 503 + Retry-After once this many completions (prompts x n) are queued, "
                             "counting those sent to the engine core that it has not started (default: no limit)")
    parser.add_argument("--max-completions-per-request", type=int, default=128,
                        help="400 for a request asking for more completions (prompts x n) than this (default: 128, "
                             "OpenAI's largest n)")
    parser.add_argument("--max-stop-strings", type=int, default=16,
                        help="400 for a request with more stop strings than this (default: 16)")
    parser.add_argument("--reasoning-parser", choices=sorted(PARSERS), default=None,
                        help="chat replies' <think>...</think> in reasoning_content, the answer in content "
                             "(deepseek_r1: the reply may start inside the thinking; qwen3: only a reply "
                             "opening with <think> thinks; default: none, the whole reply is content)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let chat requests with tools use tool_choice "auto" (the default with tools): the model '
                             "decides, and --tool-call-parser reads its calls back into tool_calls")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen2.5, "
                             "Qwen3) or llama3_json (a JSON reply: Llama 3.1-3.3)")
    parser.add_argument(
        "--engine-process", action=argparse.BooleanOptionalAction, default=True,
        help="run the engine core in its own process, this one tokenizing, detokenizing and answering HTTP "
             "(vLLM's layout); --no-engine-process: the engine core in a thread of this process; multi-host "
             "leaders always use the thread",
    )
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT folders) served under NAME: a request's `model` picks one "
                             "(needs --enable-lora)")
    parser.add_argument("--max-request-bytes", type=int, default=10 * 2**20, help="413 for larger request bodies")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds in-flight requests may take to finish before they are aborted")
