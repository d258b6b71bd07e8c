"""Peak memory of an engine's start-up, by weights: `python -m benchmarks.startup_rss [--result-json r.json]`.

Each engine is built in a fresh process (`LLM(model)` with the options below, then a few generated
tokens: reading, converting, quantizing or packing the weights, sizing the KV pool and compiling the steps
included), one after another, and its peak resident memory (VmHWM, the process's own high-water mark:
a child's ru_maxrss would keep its parent's peak from before the exec) is reported against float32's.
Issue 38 asks for the GGUF file served as stored against today's float32 start-up.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from cbjax.bench.common import print_table, write_json

GGUF = "downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
PROBE = """
import sys
from cbjax import LLM, SamplingParams
llm = LLM(sys.argv[1], quantization=sys.argv[2] or None, quantize_lm_head=sys.argv[3] == "1", max_num_seqs=16,
          max_model_len=512)
llm.generate([{"prompt_token_ids": [100, 200, 300]}], SamplingParams(max_tokens=4), use_tqdm=False)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def peak_rss_mib(model: str, quantization: str | None, lm_head: bool = False) -> float:
    """VmHWM of a fresh process that builds LLM(model) and generates a few tokens, MiB."""
    done = subprocess.run([sys.executable, "-c", PROBE, model, quantization or "", "1" if lm_head else "0"],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the start-up probe of {model} exited {done.returncode}: {done.stderr[-2000:]}")
    return int(done.stdout.split()[-1]) / 1024  # KiB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--gguf", default=GGUF)
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    engines = {"float32": (args.model, None, False), "int8": (args.model, "int8", False),
               "int8-lm-head": (args.model, "int8", True), "int4-g32": (args.model, "int4-g32", False),
               "gguf-as-stored": (args.gguf, None, False)}
    rss = {name: peak_rss_mib(*spec) for name, spec in engines.items()}
    rows = [{"weights": name, "peak_rss_mib": mib, "vs_float32": mib / rss["float32"]} for name, mib in rss.items()]
    print_table(rows, ["weights", "peak_rss_mib", "vs_float32"])
    write_json(args.result_json, {"rows": rows})


if __name__ == "__main__":
    main()
