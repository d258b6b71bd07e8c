"""Run in a fresh process with 4 virtual CPU devices (see test_tensor_parallel.py): one JSON line of findings.

XLA_FLAGS must be set before jax is imported, so these checks cannot share the pytest process.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from test_engine import COMPILES, CompileCounter  # noqa: E402
from tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

from cbjax import LLM, SamplingParams  # noqa: E402
from cbjax.checkpoint.params import param_name  # noqa: E402
from cbjax.checkpoint.convert import PARAMS_DIR  # noqa: E402
from cbjax.checkpoint.loader import _restore_orbax  # noqa: E402
from cbjax.config import ModelConfig  # noqa: E402
from cbjax.engine.config import EngineConfig  # noqa: E402
from cbjax.engine.sharding import TensorParallel  # noqa: E402
from cbjax.engine.engine import LLMEngine  # noqa: E402

ENGINE_OPTIONS = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, block_size=8)
# Per-device pool budgets of 20 blocks (hand-worked in the test): too small for all four requests at
# once, so some are preempted and recomputed.
KV_CACHE_MEMORY_BYTES = {"llama": 40960, "qwen2": 40960, "qwen3": 81920}
PROMPT_LENGTHS = (60, 45, 37, 5)  # chunked: longer than max_num_batched_tokens
MAX_TOKENS = 10


def prompts() -> list[list[int]]:
    return [[3 + (7 * i + 13 * n) % 290 for i in range(n)] for n in PROMPT_LENGTHS]


def serve(arch: str, ckpt: Path, tp: int, compiles: CompileCounter) -> dict:
    llm = LLM(str(ckpt), tensor_parallel_size=tp, kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES[arch], **ENGINE_OPTIONS)
    runner = llm.llm_engine.runner
    state = jax.tree_util.tree_unflatten(runner._state_treedef, runner.weights)
    weights = {
        param_name(path): {
            "shape": list(variable.shape),
            "shard_shapes": sorted({tuple(s.data.shape) for s in variable.get_value().addressable_shards}),
            "num_devices": len(variable.get_value().sharding.device_set),
        }
        for path, variable in nnx.to_flat_state(state)
    }
    compiles.armed = True
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts()],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    compiles.armed = False
    k_pages = runner.kv_caches[0][0]  # read after serving: each step donates the pool and replaces it
    stats = llm.get_stats()
    return {
        "token_ids": [o.outputs[0].token_ids for o in outs],
        "weights": weights,
        "pool": {"shape": list(k_pages.shape), "shard_shapes": sorted({tuple(s.data.shape) for s in k_pages.addressable_shards})},
        "num_blocks": llm.llm_engine.block_manager.num_blocks,
        "num_preemptions": stats["num_preemptions"],
        "compiles_while_serving": compiles.count,
    }


def cuda_lowering_failures(ckpt: Path, tp: int) -> list[str]:
    """Every bucket lowered for CUDA (Pallas kernels under shard_map) with the TP shardings; what failed."""
    engine = LLMEngine(EngineConfig(model=str(ckpt), tensor_parallel_size=tp, num_kv_blocks=40, **ENGINE_OPTIONS), precompile=False)
    return [f"{bucket}: {error}" for bucket, error in engine.runner.lower_all("cuda", "pallas") if error is not None]


def restored_shard_shapes(ckpt: Path, tp: int) -> dict[str, list]:
    """Shard shapes of tensors as orbax restores them, before any device_put: straight into shardings."""
    config = ModelConfig.from_dir(ckpt)
    tensor_parallel = TensorParallel.create(config, tp)
    params = _restore_orbax(ckpt / PARAMS_DIR, config, config.dtype, cast=False, sharding=tensor_parallel.restore_sharding)
    return {name: sorted({tuple(s.data.shape) for s in array.addressable_shards}) for name, array in params.items()}


def refusal(ckpt: Path, tp: int) -> str:
    try:
        LLM(str(ckpt), tensor_parallel_size=tp, **ENGINE_OPTIONS)
    except ValueError as error:
        return str(error)
    return "no error"


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    compiles = COMPILES
    llama = make_tiny_checkpoint(tmp / "llama", "llama")  # 4 heads, 2 KV heads
    qwen2 = make_tiny_checkpoint(tmp / "qwen2", "qwen2")  # q/k/v biases, split and repeated with their columns
    qwen3 = make_tiny_checkpoint(tmp / "qwen3", "qwen3", num_key_value_heads=1)  # qk-norm, head_dim 32
    result = {
        "hf_dirs": {"llama": str(llama[0]), "qwen2": str(qwen2[0]), "qwen3": str(qwen3[0])},
        "prompts": prompts(),
        "llama": {tp: serve("llama", llama[1], tp, compiles) for tp in (2, 4)},
        "qwen2": {4: serve("qwen2", qwen2[1], 4, compiles)},
        "qwen3": {4: serve("qwen3", qwen3[1], 4, compiles)},
        "restored_shard_shapes": restored_shard_shapes(llama[1], 2),
        "cuda_lowering_failures": cuda_lowering_failures(llama[1], 4),
        "refusals": {"too_many_devices": refusal(llama[1], 8), "heads_not_divisible": refusal(llama[1], 3)},
    }
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
