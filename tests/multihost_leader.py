"""Process 0 of the 2-process test (see test_multihost.py): serve greedy requests, print one JSON line.

argv: CHECKPOINT COORDINATOR MODE, MODE "exit" (generate, print, exit: that stops the worker),
"stay" (generate, print, then wait to be killed: the worker must end with an error) or "serve"
(generate, print, then keep generating until a step fails: the test kills the worker meanwhile;
print "PEER_LOST <message>" and let the error end the process).
"""

from __future__ import annotations

import json
import os
import sys
import time

from xla_flags import with_host_devices  # noqa: E402

os.environ["XLA_FLAGS"] = with_host_devices(2)  # before jax starts

from multihost_options import ENGINE_OPTIONS, MAX_TOKENS, prompts  # noqa: E402

from cbjax import LLM, SamplingParams  # noqa: E402
from cbjax.worker.distributed.multihost import PeerLostError  # noqa: E402


def main() -> None:
    checkpoint, coordinator, mode = sys.argv[1:]
    llm = LLM(checkpoint, coordinator=coordinator, num_processes=2, process_id=0, **ENGINE_OPTIONS)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts()],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    runner = llm.llm_engine.runner
    # The first prompt four times at once: each finds its cached blocks, more block-table entries
    # than a step carries, so the leader sends the surplus to the worker first (runner.write_table).
    table_writes, write_table = [], runner.write_table
    runner.write_table = lambda packed: (table_writes.append(1), write_table(packed))
    repeated = llm.generate([{"prompt_token_ids": prompts()[0]}] * 4,
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    del runner.write_table
    k_pages = runner.kv_pool[0]  # every layer's K
    print("RESULT " + json.dumps({
        "token_ids": [o.outputs[0].token_ids for o in outputs],
        "repeated_token_ids": [o.outputs[0].token_ids for o in repeated],
        "repeated_cached_tokens": [o.num_cached_tokens for o in repeated],
        "table_writes": len(table_writes),
        "num_preemptions": llm.get_stats()["num_preemptions"],
        "pool_devices": sorted(f"{d.process_index}:{d.id}" for d in k_pages.sharding.device_set),
        "pool_local_shard_shapes": sorted({tuple(s.data.shape) for s in k_pages.addressable_shards}),
        "pool_shape": list(k_pages.shape),
    }), flush=True)
    if mode == "stay":
        time.sleep(600)
    while mode == "serve":
        try:
            llm.generate([{"prompt_token_ids": p} for p in prompts()], SamplingParams(temperature=0.0, max_tokens=64),
                         use_tqdm=False)
        except PeerLostError as error:
            print(f"PEER_LOST {error}", flush=True)
            raise


if __name__ == "__main__":
    main()
