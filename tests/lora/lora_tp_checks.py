"""Run in a fresh process with 2 virtual CPU devices (see test_lora_tensor_parallel.py): one JSON line of findings.

XLA_FLAGS must be set before jax is imported, so these checks cannot share the pytest process.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from xla_flags import with_host_devices  # noqa: E402

os.environ["XLA_FLAGS"] = with_host_devices(2)

from test_lora_engine import ADAPTERS, NUM_TOKENS, greedy, make_adapters  # noqa: E402
from tiny_checkpoint import make_tiny_checkpoint  # noqa: E402
from helpers_hf import load_hf_model  # noqa: E402

from cbjax import LLM, LoRARequest, SamplingParams  # noqa: E402
from cbjax.checkpoint.params import param_name  # noqa: E402
import jax  # noqa: E402
from flax import nnx  # noqa: E402

OPTIONS = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, block_size=8, num_kv_blocks=40,
               dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, tensor_parallel_size=2)
PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11, 8, 64, 33, 90], [12, 13], [200, 100, 50, 25]]


def main() -> None:
    root = Path(tempfile.mkdtemp())
    hf_dir, checkpoint = make_tiny_checkpoint(root, "qwen3")  # q wider than hidden, q/k norms
    references = make_adapters(root, hf_dir)
    names = [None, *ADAPTERS]
    requests = [None, *(LoRARequest(name, index + 1, str(root / name)) for index, name in enumerate(ADAPTERS))]
    llm = LLM(str(checkpoint), **OPTIONS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
                           lora_request=requests, use_tqdm=False)
    expected = [greedy(load_hf_model(hf_dir) if name is None else references[name], p, NUM_TOKENS)
                for name, p in zip(names, PROMPTS)]
    runner = llm.llm_engine.runner
    state = nnx.state(nnx.merge(runner.graphdef, jax.tree_util.tree_unflatten(runner._state_treedef, runner.weights)))
    shards = {param_name(path): sorted({tuple(s.data.shape) for s in variable.get_value().addressable_shards})
              for path, variable in nnx.to_flat_state(state) if "lora" in param_name(path) and ".layers.0." in param_name(path)}
    failures = [f"{bucket}: {error}" for bucket, error in runner.lower_all("cuda", "pallas") if error is not None]
    sys.stdout.write("RESULT " + json.dumps({
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs], "expected": expected,
        "shard_shapes": shards, "cuda_lowering_failures": failures}) + "\n")


if __name__ == "__main__":
    main()
