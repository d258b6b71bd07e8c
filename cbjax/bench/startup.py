"""Where start-up goes: `LLM(model)` cold and warm, and `cbjax generate --chat` to its first token.

    python -m cbjax.bench.startup --model checkpoints/smollm2-135m-instruct [--out startup.json]
        [--generate-against '--max-num-seqs 64 --max-num-batched-tokens 512' --rounds 2]

Every measurement runs in a fresh process. "cold" starts with empty compilation and kernel
caches (temporary folders), "warm" reuses what the cold run left there. The phases are timed
by wrapping the engine's own calls in the child process; `peak_rss_mb` is the child's peak
resident memory (getrusage). The result is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

CHAT = "What is the capital of France?"
SPAWN_TIME_ENV = "CBJAX_BENCH_SPAWN_TIME"


def _timed(owner: object, name: str, phases: dict[str, float], phase: str) -> None:
    """Wrap owner.name so its wall time adds to phases[phase]."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


def count_compiles() -> dict[str, int]:
    """Count JAX's persistent-cache events from now on (pass the result to `compiles`)."""
    import jax

    events: dict[str, int] = {}
    jax.monitoring.register_event_listener(lambda event, **_: events.__setitem__(event, events.get(event, 0) + 1))
    return events


def compiles(events: dict[str, int]) -> int:
    """XLA compilations so far: executables asked of the persistent cache that it did not have."""
    return events.get("/jax/compilation_cache/compile_requests_use_cache", 0) - events.get("/jax/compilation_cache/cache_hits", 0)


def child(model: str, options: dict) -> None:
    """Build LLM(model) once, timing its phases; print them as JSON."""
    import cbjax.engine.llm_engine as engine_module
    from cbjax import LLM
    from cbjax.worker.model_runner import ModelRunner
    from cbjax.tokenizer.tokenizer import Tokenizer

    # Python's start and the imports (`-m cbjax.bench.startup` imports cbjax before child() runs).
    phases = {"python start + imports": time.time() - float(os.environ[SPAWN_TIME_ENV])}
    cache_events = count_compiles()
    _timed(engine_module, "load_model", phases, "load weights")
    _timed(Tokenizer, "from_dir", phases, "tokenizer")
    _timed(engine_module, "resolve_backend", phases, "attention backend (kernel build)")
    _timed(ModelRunner, "precompile", phases, "compile or cache load + warm-up")
    _timed(ModelRunner, "warm_up", phases, "warm-up")
    built = time.perf_counter()
    llm = LLM(model, **options)
    phases["LLM() total"] = time.perf_counter() - built
    phases["compile or cache load"] = phases.pop("compile or cache load + warm-up") - phases["warm-up"]
    start = time.perf_counter()
    llm.chat([{"role": "user", "content": CHAT}], use_tqdm=False)
    phases["first chat request"] = time.perf_counter() - start
    stats = llm.get_stats()
    print(json.dumps({"phases_s": {k: round(v, 2) for k, v in phases.items()}, "buckets": stats["buckets"],
                      "kv_blocks_total": stats["kv_blocks_total"], "xla_compiles": compiles(cache_events)}))


def child_generate(model: str, flags: list[str]) -> None:
    """`cbjax generate --chat` as a user runs it, then its XLA compile count on the last stdout line."""
    from cbjax.entrypoints.cli.main import main as cli_main

    cache_events = count_compiles()
    cli_main(["generate", "--model", model, "--chat", CHAT, "--max-tokens", "16", *flags])
    print(json.dumps({"xla_compiles": compiles(cache_events)}))


def _run(command: list[str], env: dict[str, str], cwd: str | None = None) -> tuple[str, float, float, float]:
    """Run a process (in `cwd`); (stdout, seconds to its first output byte, total seconds, peak RSS MB)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, env=env | {SPAWN_TIME_ENV: repr(time.time())}, cwd=cwd)
    first = process.stdout.read(1)
    first_byte = time.perf_counter() - start
    rest = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    total = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed with status {status}")
    return (first + rest).decode(), first_byte, total, usage.ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--options", default="{}", help="LLM options as JSON, e.g. '{\"max_num_seqs\": 32}'")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    parser.add_argument("--generate-against", default=None,
                        help="other `cbjax generate` flags to time side by side with its defaults, "
                             "e.g. '--max-num-seqs 64 --max-num-batched-tokens 512'")
    parser.add_argument("--rounds", type=int, default=1, help="warm `cbjax generate` runs per variant (median)")
    parser.add_argument("--child", choices=["llm", "generate"], help=argparse.SUPPRESS)
    parser.add_argument("--flags", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    if args.child:
        child(args.model, options) if args.child == "llm" else child_generate(args.model, shlex.split(args.flags))
        return
    result: dict = {"model": args.model, "options": options}
    with tempfile.TemporaryDirectory() as caches:
        env = os.environ | {"CBJAX_CACHE_DIR": caches}  # compiled steps and the built kernel both go there
        for name in ("CBJAX_DISABLE_COMPILE_CACHE", "CBJAX_KERNEL_CACHE"):
            env.pop(name, None)
        llm_command = [sys.executable, "-m", "cbjax.bench.startup", "--child", "llm", "--model", args.model, "--options", args.options]
        for run in ("cold", "warm"):
            stdout, _, total, rss = _run(llm_command, env)
            result[run] = json.loads(stdout.strip().splitlines()[-1]) | {"process_s": round(total, 2), "peak_rss_mb": round(rss)}
        variants = {"defaults": ""} | ({"against": args.generate_against} if args.generate_against else {})
        result["generate_chat"] = {name: {"flags": flags, "warm_first_token_s": []} for name, flags in variants.items()}
        # A first run per variant puts its steps in the cache (the kernel is built by then); then
        # warm runs alternate between the variants, so both see the same machine.
        for run in ["cold"] + ["warm"] * args.rounds:
            for name, flags in variants.items():
                command = [sys.executable, "-m", "cbjax.bench.startup", "--child", "generate", "--model", args.model,
                           f"--flags={flags}"]
                stdout, first_token, total, rss = _run(command, env)
                *text, counts = stdout.strip().splitlines()
                entry = result["generate_chat"][name]
                if run == "cold":
                    entry["cold_first_token_s"] = round(first_token, 2)
                else:
                    entry["warm_first_token_s"].append(round(first_token, 2))
                    entry |= {"peak_rss_mb": round(rss), "text": "\n".join(text)} | json.loads(counts)
        for entry in result["generate_chat"].values():
            entry["warm_first_token_median_s"] = statistics.median(entry["warm_first_token_s"])
    emit(result, args.out)


def emit(result: dict, out: str | None) -> None:
    """Print the JSON result, and write it to `out` if given."""
    print(json.dumps(result, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
