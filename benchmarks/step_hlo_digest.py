"""A digest of each step program's optimized HLO, without names and source locations: two checkouts
whose digests agree compile the same steps, op for op.

    PYTHONPATH=OLD_DIR python benchmarks/step_hlo_digest.py    # run in each checkout, compare the lines
    PYTHONPATH=. python benchmarks/step_hlo_digest.py

For every program of the default engine (SmolLM2, float32, no compilation cache): its optimized
HLO's entry computation, each instruction with its name, numeric suffixes, source metadata and
region names removed, sorted, hashed. Prints one line per program: kind, tokens, requests,
instruction count, digest.
"""

from __future__ import annotations

import argparse
import hashlib
import re

from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine


def normalized_entry(hlo: str) -> list[str]:
    """The entry computation's instructions without what differs between equal programs."""
    lines = []
    for line in hlo[hlo.index("ENTRY"):].splitlines():
        if "=" not in line:
            continue
        line = re.sub(r"\.\d+", "", line)  # numeric suffixes of names
        line = line.split(", metadata=")[0]  # source metadata (op names, stack frame ids)
        line = re.sub(r"[%.\w-]+\s*=\s*", "", line)  # the instruction's own name, attribute names
        line = re.sub(r', \{"[^"]*" \d+\}', "", line)  # source locations
        line = re.sub(r"(\"Cbjax\w+)_[0-9a-f]{16}\"", r'\1"', line)  # the C++ kernels' build hash (their sources' text)
        lines.append(re.sub(r"region_\d+", "region", line).strip())
    return sorted(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    args = parser.parse_args()
    runner = LLMEngine(EngineConfig(model=args.model, compilation_cache_dir=None), precompile=False).runner
    for bucket in dict.fromkeys(runner._step_shapes(runner.buckets).values()):
        lines = normalized_entry(runner._compile(bucket).as_text())
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
        print(bucket.kind, bucket.num_tokens, bucket.num_reqs, len(lines), digest, flush=True)


if __name__ == "__main__":
    main()
