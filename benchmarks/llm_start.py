"""Seconds of `import cbjax` and of `LLM(...)` with the demo's engine options, in this process.

    PYTHONPATH=<checkout> python benchmarks/llm_start.py      (from the checkout: checkpoints/ is relative)

One line: `import <s> LLM() <s>`. Run in fresh processes, checkouts alternated, to compare warm
starts (the caches as earlier runs left them; CBJAX_CACHE_DIR picks another cache folder).
"""

from __future__ import annotations

import time

start = time.perf_counter()
from cbjax import LLM  # noqa: E402 - the import is timed

imported = time.perf_counter()
llm = LLM("checkpoints/smollm2-135m-instruct", max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=256,
          compilation_cache_dir="auto")
print(f"import {imported - start:.2f} LLM() {time.perf_counter() - imported:.2f}")
