"""Run in a fresh process with 4 virtual CPU devices (see test_tensor_parallel.py): one JSON line of findings.

XLA_FLAGS must be set before jax is imported, so these checks cannot share the pytest process.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from xla_flags import with_host_devices  # noqa: E402

os.environ["XLA_FLAGS"] = with_host_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from engine_helpers import COMPILES, CompileCounter, random_prompts  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from fp8_checkpoints import write_fp8_checkpoint  # noqa: E402
from test_gguf_import import QUANT_TYPES, write_tiny_llama_gguf  # noqa: E402
from tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

from cbjax import LLM, SamplingParams  # noqa: E402
from cbjax.sampling_params import StructuredOutputsParams  # noqa: E402
from cbjax.checkpoint.params import expected_params, param_name  # noqa: E402
from cbjax.worker.compilation.abstract_lowering import abstract_runner, argument_shardings, num_partitions  # noqa: E402
from cbjax.plan.capacity import load_model_config  # noqa: E402
from cbjax.checkpoint.gguf_import import write_as_stored_dir  # noqa: E402
from cbjax.checkpoint.layout import PARAMS_DIR  # noqa: E402
from cbjax.checkpoint.loader import _restore_orbax  # noqa: E402
from cbjax.models.config import ModelConfig  # noqa: E402
from cbjax.config import EngineConfig  # noqa: E402
from cbjax.worker.distributed.sharding import TensorParallel  # noqa: E402
from cbjax.engine.llm_engine import LLMEngine  # noqa: E402
from cbjax.worker.sample.penalty_state import NO_SLOT, init_penalty_state  # noqa: E402
from cbjax.worker.sample.sampler import SamplingRow, SamplingTensors, build_sampling_tensors, sample  # noqa: E402
from cbjax.worker.sample.sharded import (  # noqa: E402
    SHARD_CANDIDATES,
    needs_whole_rows,
    sample_from_candidates,
    sample_vocab_sharded,
)
from cbjax.models.layers.mesh import MODEL_AXIS  # noqa: E402

ENGINE_OPTIONS = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, block_size=8)
# Per-device pool budgets of 20 blocks (hand-worked in the test): too small for all four requests at
# once, so some are preempted and recomputed.
KV_CACHE_MEMORY_BYTES = {"llama": 40960, "mixtral": 40960}
PROMPT_LENGTHS = (60, 45, 37, 5)  # chunked: longer than max_num_batched_tokens
MAX_TOKENS = 10
# Seeded sampling: the first two rows take the devices' candidates under TP, the third (top-p alone)
# and fourth (a penalty) the gathered rows; all must give TP=1's tokens.
SEEDED = [
    dict(temperature=0.8, top_k=20, seed=1),
    dict(temperature=1.0, top_k=8, top_p=0.7, min_p=0.02, seed=2),
    dict(temperature=0.9, top_p=0.9, seed=3),
    dict(temperature=0.8, top_k=20, presence_penalty=0.5, seed=4),
]


def seeded_token_ids(llm: LLM) -> list[list[int]]:
    prompts_and_params = [(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw)) for p, kw in zip(prompts(), SEEDED)]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in prompts_and_params], [sp for _, sp in prompts_and_params],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# Constrained rows under TP: the masks are replicated and applied to the vocab-split logits before sampling.
CONSTRAINTS = [StructuredOutputsParams(regex=r"[a-e]{3,8}-[0-9]{2}"),
               StructuredOutputsParams(json={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                             "minItems": 1, "maxItems": 3})]


def constrained_outputs(llm: LLM) -> list[dict]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()[:len(CONSTRAINTS)]],
                        [SamplingParams(temperature=1.0, seed=5, max_tokens=24, structured_outputs=c) for c in CONSTRAINTS],
                        use_tqdm=False)
    return [{"token_ids": o.outputs[0].token_ids, "text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason}
            for o in outs]


def prompts() -> list[list[int]]:
    return [[3 + (7 * i + 13 * n) % 290 for i in range(n)] for n in PROMPT_LENGTHS]


def serve(arch: str, ckpt: Path, tp: int, compiles: CompileCounter, attention_backend: str = "auto",
          constrained: bool = False) -> dict:
    llm = LLM(str(ckpt), tensor_parallel_size=tp, kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES[arch],
              attention_backend=attention_backend, **ENGINE_OPTIONS)
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
    seeded = seeded_token_ids(llm)
    constrained_runs = constrained_outputs(llm) if constrained else None
    compiles.armed = False
    k_pages = runner.kv_pool[0]  # every layer's K, read after serving: each step donates the pool and replaces it
    stats = llm.get_stats()
    return {
        "token_ids": [o.outputs[0].token_ids for o in outs],
        "seeded_token_ids": seeded,
        "constrained": constrained_runs,
        "weights": weights,
        "pool": {"shape": list(k_pages.shape), "shard_shapes": sorted({tuple(s.data.shape) for s in k_pages.addressable_shards})},
        "num_blocks": llm.llm_engine.block_manager.num_blocks,
        "num_preemptions": stats["num_preemptions"],
        "compiles_while_serving": compiles.count,
        "backend": llm.llm_engine.backend,
        "tensor_parallel_size": llm.llm_engine.config.tensor_parallel_size,
    }


def speculative_serve(ckpt: Path, tp1: LLM, compiles: CompileCounter) -> dict:
    """Greedy with n-gram drafts at TP=2 (the C++ kernel) and TP=1's tokens without drafts, on prompts
    that repeat themselves (drafts get accepted), chunked (longer than the 8-token steps); the
    compiles while the TP=2 engine serves them. Two rows, k=3 and 8-token steps: three compiled steps
    (a decode, one request verifying, and the rest: prompt chunks, two requests verifying)."""
    prompts = [(base * 12)[:length] for base, length in zip(random_prompts(7, [5, 7, 3]), [23, 40, 17])]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(ckpt), tensor_parallel_size=2, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=8,
              block_size=8, num_kv_blocks=40, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                   "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    before, compiles.armed = compiles.count, True
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    compiles.armed = False
    tp1_outs = tp1.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.get_stats()
    return {
        "token_ids": [o.outputs[0].token_ids for o in outs],
        "tp1_token_ids": [o.outputs[0].token_ids for o in tp1_outs],
        "tensor_parallel_size": llm.llm_engine.config.tensor_parallel_size,
        "num_draft_tokens": stats["spec_decode_num_draft_tokens"],
        "num_accepted_tokens": stats["spec_decode_num_accepted_tokens"],
        "compiles_while_serving": compiles.count - before,
    }


def cuda_lowering_failures(ckpt: Path, tp: int) -> list[str]:
    """Every bucket lowered for CUDA (Pallas kernels under shard_map) with the TP shardings; what failed."""
    engine = LLMEngine(EngineConfig(model=str(ckpt), tensor_parallel_size=tp, num_kv_blocks=40, **ENGINE_OPTIONS), precompile=False)
    return [f"{bucket}: {error}" for bucket, error in engine.runner.lower_all("cuda", "pallas") if error is not None]


def shard_map_inputs(lowered_text: str) -> collections.Counter[str]:
    """How many inputs of the lowered step's shard_maps (sdy.manual_computation) carry each sharding."""
    specs = re.findall(r"sdy\.manual_computation\(.*?in_shardings=\[(.*?)\] out_shardings", lowered_text)
    return collections.Counter(spec for found in specs for spec in re.findall(r"<@mesh, (\[.*?\])>", found))


def abstract_lowering(config: ModelConfig, tp: int, expert_parallel: bool = False) -> dict:
    """Every bucket lowered for CUDA from the config alone (cbjax lower --config): what failed, the
    partitions, argument shardings and shard_map input shardings each step has, and the device bytes
    that building it allocated."""
    live_bytes = lambda: sum(a.nbytes for a in jax.live_arrays())  # noqa: E731
    before = live_bytes()
    engine_config = EngineConfig(model="abstract", tensor_parallel_size=tp, enable_expert_parallel=expert_parallel,
                                 **ENGINE_OPTIONS)
    runner = abstract_runner(config, engine_config, "cuda")
    found = {"failures": [], "partitions": [], "shardings": [], "shard_map_inputs": [],
             "allocated_bytes": live_bytes() - before}
    for bucket in runner.buckets:
        try:
            text = runner.lower_for(bucket, "cuda", "pallas").as_text()
        except Exception as error:  # noqa: BLE001 - the test lists them
            found["failures"].append(f"{bucket}: {error}")
            continue
        found["partitions"].append(num_partitions(text))
        found["shardings"].append(dict(argument_shardings(text)))
        found["shard_map_inputs"].append(dict(shard_map_inputs(text)))
    return found


def tp_logits(ckpt: Path, tp: int, expert_parallel: bool = False, quantization: str | None = None,
              pool_dtype=jnp.float32, calculate_kv_scales: bool = False) -> dict:
    """A model's float32 logits at every position of one prompt (prefilled in one mixed step from a NaN
    pool of `pool_dtype`) with its weights split over `tp` devices (a MoE model's experts placed whole on
    them with expert_parallel; quantized as `quantization` says), and every weight's shape, dtype and shard shapes;
    with calculate_kv_scales, the pool's per-layer scales from a calibration step over prompts() (worker/kv_scales.py).
    A forward pass instead of an engine run (whose bucket compiles cost ~20 s a model at TP=4): the
    engine's TP path is llama's and mixtral's serve() runs."""
    from cbjax.checkpoint.loader import load_model
    from cbjax.models.layers.attention import AttentionPlan
    from cbjax.models.layers.kv_pool import init_kv_pool
    from kernels_pallas import AttentionMetadata

    tensor_parallel = TensorParallel.create(ModelConfig.from_dir(ckpt), tp, expert_parallel=expert_parallel) if tp > 1 else None
    from cbjax.worker.kv_scales import kv_amax, scales_from_amax, set_kv_scales

    model, config = load_model(ckpt, tensor_parallel=tensor_parallel, quantization=quantization)
    block_size, prompt = 8, prompts()[1]  # 45 tokens in blocks 1..6
    plan = AttentionPlan("xla", mesh=None if tensor_parallel is None else tensor_parallel.mesh, expert_parallel=expert_parallel)
    kv_scales = scales_from_amax(kv_amax(model, prompts(), block_size, plan)) if calculate_kv_scales else None
    if kv_scales is not None:
        set_kv_scales(model, kv_scales)
    graphdef, state = nnx.split(model)
    n = len(prompt)
    pool = tuple(jnp.full_like(pages, jnp.nan) for pages in init_kv_pool(config, 8, block_size, pool_dtype))
    if tensor_parallel is not None:
        pool = jax.device_put(pool, tensor_parallel.pool_sharding)
    metadata = AttentionMetadata(slot_mapping=jnp.arange(block_size, block_size + n, dtype=jnp.int32),
                                 query_start_loc=jnp.array([0, n], jnp.int32), seq_lens=jnp.array([n], jnp.int32),
                                 block_tables=jnp.arange(1, 8, dtype=jnp.int32)[None])
    step = jax.jit(lambda state, pool: nnx.merge(graphdef, state)(
        jnp.array(prompt, jnp.int32), jnp.arange(n, dtype=jnp.int32), pool, metadata, jnp.arange(n), plan)[0])
    weights = {param_name(path): {"shape": list(variable.shape), "dtype": str(variable.dtype),
                                  "shard_shapes": sorted({tuple(s.data.shape) for s in variable.get_value().addressable_shards})}
               for path, variable in nnx.to_flat_state(state)}
    return {"logits": np.asarray(step(state, pool)).tolist(), "weights": weights, "kv_scales": kv_scales}


def sharded_sampling() -> dict:
    """The sampler on logits split over 4 devices' vocabulary slices against the one-device sampler,
    on the same random logits and seeds: greedy, top-k, top-k + top-p + min-p, top_k = k (candidate
    path), and rows that need whole rows (top-p alone, penalties, min_tokens, logprobs)."""
    mesh = Mesh(np.asarray(jax.devices()[:4]), (MODEL_AXIS,))
    num_rows, vocab = 64, 1024
    logits = 3.0 * jax.random.normal(jax.random.key(0), (num_rows, vocab), jnp.float32)
    sliced = jax.device_put(logits, NamedSharding(mesh, P(None, MODEL_AXIS)))
    penalty_state = init_penalty_state(num_rows, vocab)
    candidate_params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.8, min_p=0.01),
        SamplingParams(temperature=1.3, top_k=SHARD_CANDIDATES),
    ]
    whole_row_params = [
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=0.9, top_k=SHARD_CANDIDATES + 1),
        SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, top_k=20, logprobs=2),
    ]

    def tensors(params: list[SamplingParams], suppress: list[int] = ()) -> SamplingTensors:
        rows = [SamplingRow(params[i % len(params)], seed=1000 + i, counter=i % 5, suppress_token_ids=suppress,
                            penalty_slot=i if params[i % len(params)].has_penalties else NO_SLOT) for i in range(num_rows)]
        return build_sampling_tensors(rows, num_rows, 16)

    one_device = jax.jit(lambda t: sample(logits, t, penalty_state, 2).token_ids)
    candidates = jax.jit(lambda t: sample_from_candidates(sliced, t, mesh))
    sharded = jax.jit(lambda t: sample_vocab_sharded(sliced, t, penalty_state, 2, mesh).token_ids)
    whole = jax.jit(lambda t: needs_whole_rows(t, 2))
    cases = {"candidates": tensors(candidate_params), "suppressed": tensors(candidate_params, [5, 6])}
    cases |= {f"whole_row_{i}": tensors([p]) for i, p in enumerate(whole_row_params)}
    return {
        name: {
            "one_device": one_device(t).tolist(),
            "candidates": candidates(t).tolist(),
            "sharded": sharded(t).tolist(),
            "needs_whole_rows": bool(whole(t)),
        }
        for name, t in cases.items()
    }


def restored_shard_shapes(ckpt: Path, tp: int) -> dict[str, list]:
    """Shard shapes of tensors as orbax restores them, before any device_put: straight into shardings."""
    config = ModelConfig.from_dir(ckpt)
    tensor_parallel = TensorParallel.create(config, tp)
    expected = expected_params(config, jnp.dtype(config.dtype))
    params = _restore_orbax(ckpt / PARAMS_DIR, expected, cast=False, sharding=tensor_parallel.restore_sharding)
    return {name: sorted({tuple(s.data.shape) for s in array.addressable_shards}) for name, array in params.items()}


def refusal(ckpt: Path, tp: int, **options) -> str:
    try:
        LLM(str(ckpt), tensor_parallel_size=tp, **ENGINE_OPTIONS, **options)
    except ValueError as error:
        return str(error)
    return "no error"


def tiny_gguf_as_stored(root: Path, down_type: GGMLQuantizationType) -> Path:
    """A tiny llama GGUF (test_gguf_import's: hidden 64, intermediate 96) served as stored: gate/up IQ4_NL
    (kept 4-bit, groups of 32, their nibbles indexing IQ4's grid), q/k Q4_0/Q4_1 beside a Q8_0 v (kept in their common form, int8 groups of 32 with
    mins), o Q5_1 (int8 groups of 32 with mins), down_proj `down_type`, the embedding Q8_0."""
    four_bit = {"attn_q.weight": GGMLQuantizationType.Q4_0, "attn_k.weight": GGMLQuantizationType.Q4_1,
                "attn_v.weight": GGMLQuantizationType.Q8_0, "attn_output.weight": GGMLQuantizationType.Q5_1,
                "ffn_gate.weight": GGMLQuantizationType.IQ4_NL, "ffn_up.weight": GGMLQuantizationType.IQ4_NL}
    root.mkdir()
    write_tiny_llama_gguf(root / "tiny.gguf", quant_types={**QUANT_TYPES, **four_bit, "ffn_down.weight": down_type})
    return write_as_stored_dir(root / "tiny.gguf", root / "stored")


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    compiles = COMPILES
    llama = make_tiny_checkpoint(tmp / "llama", "llama")  # 4 heads, 2 KV heads
    qwen2 = make_tiny_checkpoint(tmp / "qwen2", "qwen2")  # q/k/v biases, split and repeated with their columns
    qwen3 = make_tiny_checkpoint(tmp / "qwen3", "qwen3", num_key_value_heads=1)  # qk-norm, head_dim 32
    olmo2 = make_tiny_checkpoint(tmp / "olmo2", "olmo2", num_key_value_heads=1)  # k_norm over a repeated KV head
    gemma3 = make_tiny_checkpoint(tmp / "gemma3", "gemma3_text", head_dim=16)  # local/global layers, windowed
    gguf = tiny_gguf_as_stored(tmp / "gguf", GGMLQuantizationType.F16)  # down_proj float: its 96 rows split in 48s
    fp8 = write_fp8_checkpoint(llama[0], tmp / "fp8", "per-block")  # fp8 projections, scales per 32 x 32 block
    # 8 experts, top 2; Qwen3-MoE's layer 1 dense (tests/helpers_hf.py)
    moe = {family: make_tiny_checkpoint(tmp / family, family) for family in ("qwen3_moe", "mixtral")}
    # Every attention backend runs under shard_map: "auto" is the C++ kernel (TP=4 runs); the
    # interpreted Pallas kernels serve the TP=2 run; the jnp reference runs in tp_logits' forward passes.
    llama_tp2 = serve("llama", llama[1], 2, compiles, "pallas_interpret")
    tp1 = LLM(str(llama[1]), **ENGINE_OPTIONS)
    result = {
        "hf_dirs": {"llama": str(llama[0]), "qwen2": str(qwen2[0]), "qwen3": str(qwen3[0]), "olmo2": str(olmo2[0]),
                    **{family: str(dirs[0]) for family, dirs in moe.items()}},
        "prompts": prompts(),
        "llama": {2: llama_tp2, 4: serve("llama", llama[1], 4, compiles, constrained=True)},
        "backends": {"pallas_interpret": llama_tp2},
        "mixtral": {4: serve("mixtral", moe["mixtral"][1], 4, compiles)},
        "logits": {family: {tp: tp_logits(dirs[1], tp) for tp in (1, 2, 4)} for family, dirs in moe.items()}
        | {family: {tp: tp_logits(dirs[1], tp) for tp in (1, 4)}
           for family, dirs in (("qwen2", qwen2), ("qwen3", qwen3), ("olmo2", olmo2), ("gemma3", gemma3))},
        "expert_parallel_logits": {family: {ep: tp_logits(dirs[1], ep, expert_parallel=True) for ep in (2, 4)}
                                   for family, dirs in moe.items()},
        "int8_logits": {tp: tp_logits(llama[1], tp, quantization="int8") for tp in (1, 2)},
        "int4_logits": {tp: tp_logits(llama[1], tp, quantization="int4-g32") for tp in (1, 2)},
        "gguf_logits": {tp: tp_logits(gguf, tp) for tp in (1, 2)},
        "fp8_logits": {tp: tp_logits(fp8, tp) for tp in (1, 2)},
        "fp8_kv_logits": {tp: tp_logits(llama[1], tp, pool_dtype=jnp.float8_e4m3fn)["logits"] for tp in (1, 2)},
        "fp8_kv_calculated_scales": {tp: {key: run[key] for key in ("logits", "kv_scales")} for tp in (1, 2) for run in
                                     [tp_logits(llama[1], tp, pool_dtype=jnp.float8_e4m3fn, calculate_kv_scales=True)]},
        "restored_shard_shapes": restored_shard_shapes(llama[1], 2),
        "tp1_seeded_token_ids": seeded_token_ids(tp1),
        "speculative": speculative_serve(llama[1], tp1, compiles),
        "tp1_constrained": constrained_outputs(tp1),
        "sharded_sampling": sharded_sampling(),
        "cuda_lowering_failures": cuda_lowering_failures(llama[1], 4),
        "fp8_cuda_lowering_failures": cuda_lowering_failures(fp8, 2),
        "abstract_lowering": {
            "llama": {tp: abstract_lowering(ModelConfig.from_dir(llama[1]), tp) for tp in (2, 4)},
            # Llama-3-70B's shapes (64 heads, 8 KV heads, head_dim 128, vocab 128256), two of its 80 layers
            "llama-3-70b": {4: abstract_lowering(dataclasses.replace(load_model_config("llama-3-70b")[1], num_hidden_layers=2), 4)},
            # The engine's step under expert parallelism: its MoE shard_maps take whole experts
            "mixtral-ep": {4: abstract_lowering(ModelConfig.from_dir(moe["mixtral"][1]), 4, expert_parallel=True)},
        },
        "refusals": {"too_many_devices": refusal(llama[1], 8), "heads_not_divisible": refusal(llama[1], 3),
                     # o_proj's 64 inputs in groups of 32: 16 a device at TP=4; the GGUF's Q4_0 down_proj: 96 in groups of 32, 48 at TP=2
                     "int4_groups_not_whole": refusal(llama[1], 4, quantization="int4-g32"),
                     "gguf_groups_not_whole": refusal(tiny_gguf_as_stored(tmp / "gguf_q4_down", GGMLQuantizationType.Q4_0), 2)},
    }
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
