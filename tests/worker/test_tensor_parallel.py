"""Tensor parallelism over 4 virtual CPU devices: greedy outputs equal transformers' with the C++ and
interpreted Pallas attention under shard_map (the jnp one gives TP=1's logits), every weight and the KV pool
are really split as Megatron-style TP says (shard shapes worked by hand), and every step lowers
for CUDA with those shardings, from a checkpoint or from a config alone (abstract weights).

The engines run in one subprocess (tensor_parallel_checks.py): the device count is fixed when
jax starts. Tiny configs: hidden 64, intermediate 128, vocab 320, 4 heads of 16 (Qwen3: of 32),
2 KV heads (Qwen3, OLMo-2: 1).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import hf_greedy

TESTS = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def findings() -> dict:
    # Virtual CPU devices by design, also on a GPU host (where JAX would pick its one GPU instead).
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), str(TESTS / "checkpoint"),  # test_gguf_import's writer
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(TESTS / "tensor_parallel_checks.py")], env=env, capture_output=True, text=True, timeout=900
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.parametrize(("arch", "tp"), [("llama", "2"), ("llama", "4"), ("mixtral", "4")])
def test_greedy_outputs_equal_transformers(findings, arch, tp):
    # TP=4 runs the C++ CPU kernel per device; TP=2 the interpreted Pallas kernels
    # Prompts of 60/45/37 tokens are prefilled in chunks of at most 32, and the 20-block pool preempts.
    run = findings[arch][tp]
    want = [hf_greedy(Path(findings["hf_dirs"][arch]), prompt, 10) for prompt in findings["prompts"]]
    assert run["token_ids"] == want
    assert run["num_preemptions"] > 0


# The jnp attention ("xla") under shard_map: test_dense_families_split_over_4_devices_give_tp1_logits.
@pytest.mark.parametrize(("backend", "tp"), [("cpp", 4), ("pallas_interpret", 2)])
def test_attention_backends_under_shard_map_greedy_equals_transformers(findings, backend, tp):
    run = findings["llama"]["4"] if backend == "cpp" else findings["backends"][backend]
    want = [hf_greedy(Path(findings["hf_dirs"]["llama"]), prompt, 10) for prompt in findings["prompts"]]
    assert run["backend"] == backend and run["tensor_parallel_size"] == tp
    assert run["token_ids"] == want
    assert run["num_preemptions"] > 0


def test_no_compiles_while_serving_under_tp(findings):
    assert findings["llama"]["4"]["compiles_while_serving"] == 0


def test_ngram_speculation_at_tp2_gives_tp1_greedy_tokens_without_compiling(findings):
    """Drafts verified in steps whose weights are split over 2 devices (chunked prompts beside them):
    the tokens of TP=1 decoding one at a time, some drafts accepted and some rejected, no compile while
    serving (the verifying steps are among the buckets compiled at start-up)."""
    run = findings["speculative"]
    assert run["tensor_parallel_size"] == 2
    assert run["token_ids"] == run["tp1_token_ids"]
    assert 0 < run["num_accepted_tokens"] < run["num_draft_tokens"]
    assert run["compiles_while_serving"] == 0


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "olmo2", "gemma3"])
def test_dense_families_split_over_4_devices_give_tp1_logits(findings, family):
    """Qwen2's biases, Qwen3's q/k norms over one KV head repeated 4x, OLMo-2's whole-projection norms,
    Gemma 3's four norms per layer and windowed local layers: each family's TP plan gives TP=1's
    logits (and TP=1's equal transformers', test_model_parity)."""
    runs = findings["logits"][family]
    # Float32 sums in another order: Gemma's scaled embeddings and four norms per layer give logits near 10.
    np.testing.assert_allclose(np.array(runs["4"]["logits"]), np.array(runs["1"]["logits"]), atol=1e-4, rtol=1e-5)
    q_proj = runs["4"]["weights"]["model.layers.0.self_attn.q_proj.kernel"]
    assert q_proj["shard_shapes"] == [[q_proj["shape"][0], q_proj["shape"][1] // 4]]  # split by heads


def test_int8_weights_split_with_their_scales_give_tp1_logits(findings):
    """int8 (quantization="int8"): each projection's scales [out] travel with its output columns (q/k/v and
    gate/up split, o/down replicated), so TP=2 gives TP=1's int8 logits; shard shapes worked by hand
    for the tiny llama (hidden 64, intermediate 128, 2 KV heads of 16)."""
    runs = findings["int8_logits"]
    np.testing.assert_allclose(np.array(runs["2"]["logits"]), np.array(runs["1"]["logits"]), atol=1e-5, rtol=1e-5)
    weights = {name.removeprefix("model.layers.0."): w for name, w in runs["2"]["weights"].items()}
    want = {"self_attn.q_proj": ([32], [64, 32]), "self_attn.k_proj": ([16], [64, 16]), "mlp.up_proj": ([64], [64, 64]),
            "self_attn.o_proj": ([64], [32, 64]), "mlp.down_proj": ([64], [64, 64])}
    for module, (scales, kernel) in want.items():
        assert weights[f"{module}.kernel"]["dtype"] == "int8" and weights[f"{module}.scales"]["dtype"] == "float32"
        assert weights[f"{module}.scales"]["shard_shapes"] == [scales] and weights[f"{module}.kernel"]["shard_shapes"] == [kernel]
    assert weights["model.embed_tokens.embedding"]["dtype"] == weights["lm_head.kernel"]["dtype"] == "float32"


def test_int4_weights_split_with_their_group_scales_give_tp1_logits(findings):
    """int4 in groups of 32 (quantization="int4-g32"): nibbles [in / 2, out] split like a float kernel, their
    scales and mins [in / 32, out] by columns beside q/k/v and gate/up, by whole groups beside o/down (each
    device's rows hold whole groups), so TP=2 gives TP=1's int4 logits; shard shapes worked by hand."""
    runs = findings["int4_logits"]
    np.testing.assert_allclose(np.array(runs["2"]["logits"]), np.array(runs["1"]["logits"]), atol=1e-5, rtol=1e-5)
    weights = {name.removeprefix("model.layers.0."): w for name, w in runs["2"]["weights"].items()}
    want = {"self_attn.q_proj": ([2, 32], [32, 32]), "self_attn.k_proj": ([2, 16], [32, 16]), "mlp.up_proj": ([2, 64], [32, 64]),
            "self_attn.o_proj": ([1, 64], [16, 64]), "mlp.down_proj": ([2, 64], [32, 64])}
    for module, (groups, kernel) in want.items():
        assert weights[f"{module}.kernel"]["dtype"] == "uint8" and weights[f"{module}.kernel"]["shard_shapes"] == [kernel]
        assert weights[f"{module}.scales"]["shard_shapes"] == weights[f"{module}.mins"]["shard_shapes"] == [groups]


def test_gguf_as_stored_splits_its_4bit_projections_and_gives_tp1_logits(findings):
    """A tiny GGUF served as stored (gate/up IQ4_NL kept 4-bit in groups of 32, each with IQ4's grid whole on every
    device; q/k Q4_0/Q4_1 beside a Q8_0 v,
    and o Q5_1, kept as int8 groups of 32 with mins, o's each device's 32 input rows one group; down_proj F16;
    the Q8_0 embedding dequantized, as under TP the vocabulary split takes a float table) at TP=2 gives its TP=1
    logits (which equal its float import's: test_gguf_as_stored.py). Hidden 64, intermediate 96, 4 heads of 16,
    2 KV heads."""
    runs = findings["gguf_logits"]
    want = np.array(runs["1"]["logits"])
    np.testing.assert_allclose(np.array(runs["2"]["logits"]), want, atol=1e-5 * np.abs(want).max(), rtol=0)
    weights = {name.removeprefix("model.layers.0."): w for name, w in runs["2"]["weights"].items()}
    # module: dtype, the kernel's shard, the scales' and mins' shard
    want_shards = {"mlp.gate_proj": ("uint8", [32, 48], [2, 48]), "self_attn.q_proj": ("int8", [64, 32], [2, 32]),
                   "self_attn.v_proj": ("int8", [64, 16], [2, 16]), "self_attn.o_proj": ("int8", [32, 64], [1, 64])}
    for module, (dtype, kernel, groups) in want_shards.items():
        assert weights[f"{module}.kernel"]["dtype"] == dtype and weights[f"{module}.kernel"]["shard_shapes"] == [kernel]
        assert weights[f"{module}.scales"]["shard_shapes"] == weights[f"{module}.mins"]["shard_shapes"] == [groups]
    assert weights["mlp.gate_proj.grid"]["shard_shapes"] == weights["mlp.up_proj.grid"]["shard_shapes"] == [[16]]
    assert weights["mlp.down_proj.kernel"]["dtype"] == "float32" and weights["mlp.down_proj.kernel"]["shard_shapes"] == [[48, 64]]
    assert runs["2"]["weights"]["model.embed_tokens.embedding"]["dtype"] == "float32"


def test_fp8_checkpoint_as_stored_splits_its_block_scales_and_gives_tp1_logits(findings):
    """A checkpoint with fp8 projections and scales per 32 x 32 block (tests/checkpoint/test_fp8_checkpoint.py),
    kept as stored: e4m3 kernels split like float ones, their scales [in / 32, out] by columns beside q/k/v and
    gate/up and by whole groups beside o/down, so TP=2 gives TP=1's logits; shard shapes worked by hand for the
    tiny llama (hidden 64, intermediate 128, 2 KV heads of 16)."""
    runs = findings["fp8_logits"]
    want = np.array(runs["1"]["logits"])
    np.testing.assert_allclose(np.array(runs["2"]["logits"]), want, atol=1e-5 * np.abs(want).max(), rtol=0)
    weights = {name.removeprefix("model.layers.0."): w for name, w in runs["2"]["weights"].items()}
    want_shards = {"self_attn.q_proj": ([64, 32], [2, 32]), "self_attn.k_proj": ([64, 16], [2, 16]),
                   "mlp.up_proj": ([64, 64], [2, 64]), "self_attn.o_proj": ([32, 64], [1, 64]),
                   "mlp.down_proj": ([64, 64], [2, 64])}
    for module, (kernel, groups) in want_shards.items():
        assert weights[f"{module}.kernel"]["dtype"] == "float8_e4m3fn" and weights[f"{module}.scales"]["dtype"] == "float32"
        assert weights[f"{module}.kernel"]["shard_shapes"] == [kernel] and weights[f"{module}.scales"]["shard_shapes"] == [groups]
    assert findings["fp8_cuda_lowering_failures"] == []  # the engine's every bucket at TP=2, for CUDA


def test_fp8_pool_split_over_kv_heads_gives_tp1_logits(findings):
    """An e4m3 pool (kv_cache_dtype="fp8") split over 2 devices' KV heads: each device quantizes and reads its
    own heads, so TP=2 gives TP=1's fp8 logits (those differ from a float32 pool's by ~0.2 on the tiny llama)."""
    runs = findings["fp8_kv_logits"]
    np.testing.assert_allclose(np.array(runs["2"]), np.array(runs["1"]), atol=1e-5, rtol=1e-5)


def test_fp8_pool_with_calculated_scales_split_over_kv_heads_gives_tp1_scales_and_logits(findings):
    """calculate_kv_scales under TP: the calibration step's maxima run over every device's heads (the pool split
    over KV heads, the maximum over all of them), so each layer's scales are TP=1's, and so are the logits."""
    runs = findings["fp8_kv_calculated_scales"]
    scales = np.array(runs["1"]["kv_scales"])
    assert scales.shape == (2, 2) and not np.allclose(scales, 1.0)
    np.testing.assert_allclose(np.array(runs["2"]["kv_scales"]), scales, rtol=1e-6)
    np.testing.assert_allclose(np.array(runs["2"]["logits"]), np.array(runs["1"]["logits"]), atol=1e-5, rtol=1e-5)
    # The scales reach the attention: these logits are not scale 1.0's.
    assert not np.allclose(np.array(runs["1"]["logits"]), np.array(findings["fp8_kv_logits"]["1"]), atol=1e-5)


@pytest.mark.parametrize("tp", ["2", "4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_experts_split_within_each_expert_give_tp1_logits(findings, family, tp):
    runs, n = findings["logits"][family], int(tp)
    np.testing.assert_allclose(np.array(runs[tp]["logits"]), np.array(runs["1"]["logits"]), atol=1e-5, rtol=1e-5)
    # 8 experts of inner width 32, hidden 64: gate/up split by output columns, down by input rows.
    weights = runs[tp]["weights"]
    assert weights["model.layers.0.mlp.experts.gate_proj.kernel"]["shard_shapes"] == [[8, 64, 32 // n]]
    assert weights["model.layers.0.mlp.experts.up_proj.kernel"]["shard_shapes"] == [[8, 64, 32 // n]]
    assert weights["model.layers.0.mlp.experts.down_proj.kernel"]["shard_shapes"] == [[8, 32 // n, 64]]


@pytest.mark.parametrize("ep", ["2", "4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_experts_placed_whole_on_devices_give_tp1_logits(findings, family, ep):
    runs, n = findings["expert_parallel_logits"][family], int(ep)
    want = findings["logits"][family]["1"]["logits"]
    np.testing.assert_allclose(np.array(runs[ep]["logits"]), np.array(want), atol=1e-5, rtol=1e-5)
    # 8 experts of inner width 32, hidden 64: 8 / n whole experts per device; attention stays split by heads.
    weights = runs[ep]["weights"]
    assert weights["model.layers.0.mlp.experts.gate_proj.kernel"]["shard_shapes"] == [[8 // n, 64, 32]]
    assert weights["model.layers.0.mlp.experts.up_proj.kernel"]["shard_shapes"] == [[8 // n, 64, 32]]
    assert weights["model.layers.0.mlp.experts.down_proj.kernel"]["shard_shapes"] == [[8 // n, 32, 64]]
    assert weights["model.layers.0.mlp.gate.kernel"]["shard_shapes"] == [[64, 8]]  # the router, replicated
    q_proj = weights["model.layers.0.self_attn.q_proj.kernel"]
    assert q_proj["shard_shapes"] == [[q_proj["shape"][0], q_proj["shape"][1] // n]]


@pytest.mark.parametrize("tp", ["2", "4"])
def test_weights_split_megatron_style(findings, tp):
    n = int(tp)
    weights = findings["llama"][tp]["weights"]
    # TP=4 > 2 KV heads: k/v repeat each head twice, so k_proj holds 4 heads x 16 columns.
    kv_columns = 32 if n == 2 else 64
    want = {
        "model.embed_tokens.embedding": ([320, 64], [320 // n, 64]),  # by vocabulary
        "lm_head.kernel": ([64, 320], [64, 320 // n]),
        "model.layers.0.self_attn.q_proj.kernel": ([64, 64], [64, 64 // n]),  # output columns
        "model.layers.1.self_attn.k_proj.kernel": ([64, kv_columns], [64, kv_columns // n]),
        "model.layers.1.self_attn.v_proj.kernel": ([64, kv_columns], [64, kv_columns // n]),
        "model.layers.0.self_attn.o_proj.kernel": ([64, 64], [64 // n, 64]),  # input rows
        "model.layers.1.mlp.gate_proj.kernel": ([64, 128], [64, 128 // n]),
        "model.layers.1.mlp.up_proj.kernel": ([64, 128], [64, 128 // n]),
        "model.layers.0.mlp.down_proj.kernel": ([128, 64], [128 // n, 64]),
        "model.layers.0.input_layernorm.weight": ([64], [64]),  # replicated
        "model.norm.weight": ([64], [64]),
    }
    if n == 4:  # Qwen2's biases follow their columns; k/v's are repeated like their heads
        qwen2 = findings["logits"]["qwen2"][tp]["weights"]
        assert qwen2["model.layers.0.self_attn.q_proj.bias"]["shard_shapes"] == [[16]]
        assert qwen2["model.layers.0.self_attn.k_proj.bias"]["shape"] == [64]
        assert qwen2["model.layers.0.self_attn.k_proj.bias"]["shard_shapes"] == [[16]]
    for name, (shape, shard) in want.items():
        assert weights[name]["shape"] == shape, name
        assert weights[name]["shard_shapes"] == [shard], name
        assert weights[name]["num_devices"] == n, name
    for name, weight in weights.items():  # nothing left on one device
        assert weight["num_devices"] == n, name


@pytest.mark.parametrize(
    ("arch", "tp", "pool_heads"),
    [("llama", "2", 2), ("llama", "4", 4), ("mixtral", "4", 4)],
)
def test_pool_split_over_kv_heads_sized_per_device(findings, arch, tp, pool_heads):
    run = findings[arch][tp]
    head_dim = 16
    # Per device a block costs 2 layers x (K, V) x 1 KV head x 8 tokens x head_dim x 4 bytes.
    per_device_block = 2 * 2 * 1 * 8 * head_dim * 4
    budget = 40960  # kv_cache_memory_bytes, per device
    assert run["num_blocks"] == budget // per_device_block == 20
    # One K array for both layers: each layer's num_blocks pages, one after the other.
    assert run["pool"]["shape"] == [pool_heads, 2 * run["num_blocks"], 8, head_dim]
    assert run["pool"]["shard_shapes"] == [[1, 2 * run["num_blocks"], 8, head_dim]]


def test_olmo2_whole_projection_norms_under_tp(findings):
    # One KV head repeated 4x: k_proj's columns and k_norm's scale repeat together (4 x 16), the norms
    # replicated (each device normalizes over the whole projection, XLA summing the squares across devices).
    weights = findings["logits"]["olmo2"]["4"]["weights"]
    assert weights["model.layers.0.self_attn.k_proj.kernel"]["shard_shapes"] == [[64, 16]]
    assert weights["model.layers.0.self_attn.k_norm.weight"]["shape"] == [64]
    assert weights["model.layers.0.self_attn.k_norm.weight"]["shard_shapes"] == [[64]]
    assert weights["model.layers.1.self_attn.q_norm.weight"]["shard_shapes"] == [[64]]
    assert weights["model.layers.1.post_feedforward_layernorm.weight"]["shard_shapes"] == [[64]]


def test_orbax_restores_straight_into_shardings(findings):
    restored = findings["restored_shard_shapes"]  # TP=2, as read from the checkpoint
    assert restored["model.embed_tokens.embedding"] == [[160, 64]]
    assert restored["model.layers.0.self_attn.q_proj.kernel"] == [[64, 32]]
    assert restored["model.layers.0.mlp.down_proj.kernel"] == [[64, 64]]


def test_every_step_lowers_for_cuda_with_tp_shardings(findings):
    assert findings["cuda_lowering_failures"] == []


@pytest.mark.parametrize(("config", "tp"), [("llama", "2"), ("llama", "4"), ("llama-3-70b", "4")])
def test_every_step_lowers_for_cuda_from_abstract_weights_with_megatron_shardings(findings, config, tp):
    run = findings["abstract_lowering"][config][tp]
    assert run["failures"] == []
    assert run["allocated_bytes"] == 0  # shapes only: no weight, pool or penalty table was allocated
    assert run["partitions"] == [int(tp)] * len(run["shardings"]) and len(run["shardings"]) == 3  # 3 buckets
    # Both configs have 2 layers, untied, and a vocabulary that 2 and 4 divide. Per layer: q/k/v and gate/up
    # split by output columns, o and down by input rows; the K and V pools (one each for all layers)
    # split over KV heads. Besides: the LM head by columns (vocabulary), the embedding by rows
    # (vocabulary); the 2 norms of each layer and the final norm, replicated, travel as one [5, hidden]
    # stack (weight_stacks.py); the packed inputs and the previous step's sampled tokens (async
    # scheduling) replicated, the penalty table's two [seqs, vocab] arrays, the block table
    # (block_table.py) and the structured-output token masks [seqs, vocab / 32] (sample/grammar.py) replicated.
    want = {'[{}, {"model"}]': 2 * 5 + 1, '[{"model"}, {}]': 2 * 2 + 1, "[{}]": 1 + 1,
            '[{"model"}, {}, {}, {}]': 2, "[{}, {}]": 1 + 2 + 1 + 1}
    assert all(shardings == want for shardings in run["shardings"])


def test_engine_step_under_expert_parallelism_computes_whole_experts_per_device(findings):
    # The step the engine builds with enable_expert_parallel, lowered for CUDA: the tiny Mixtral's 2 layers'
    # gate/up/down [8, in, out] arrive split by expert and its MoE shard_maps take them so (no resharding into
    # the within-expert split); attention's shard_maps still take heads.
    run = findings["abstract_lowering"]["mixtral-ep"]["4"]
    assert run["failures"] == [] and run["partitions"] == [4] * 3
    for shardings, shard_map_inputs in zip(run["shardings"], run["shard_map_inputs"]):
        assert shardings['[{"model"}, {}, {}]'] == shard_map_inputs['[{"model"}, {}, {}]'] == 2 * 3
        assert '[{}, {}, {"model"}]' not in shard_map_inputs and '[{}, {"model"}, {}]' in shard_map_inputs


def test_refuses_what_cannot_work(findings):
    too_many, not_divisible = findings["refusals"]["too_many_devices"], findings["refusals"]["heads_not_divisible"]
    assert "tensor_parallel_size=8" in too_many and "4 present" in too_many and "[1, 2, 4]" in too_many
    assert "tensor_parallel_size=3" in not_divisible and "num_attention_heads=4 is not divisible by 3" in not_divisible
    assert "valid sizes: 1, 2, 4" in not_divisible
    int4, gguf = findings["refusals"]["int4_groups_not_whole"], findings["refusals"]["gguf_groups_not_whole"]
    assert ("model.layers.0.self_attn.o_proj cannot be split over tensor_parallel_size=4: its K=64 input rows are in 2 "
            "groups of G=32, and each device's K / 4 = 16 rows must hold whole groups; use a tensor_parallel_size that "
            "divides its 2 groups (1, 2), or a group size that divides 16") in int4
    assert ("model.layers.0.mlp.down_proj cannot be split over tensor_parallel_size=2: its K=96 input rows are in 3 "
            "groups of G=32") in gguf and "divides its 3 groups (1)" in gguf


def test_sampling_from_devices_candidates_equals_one_device_sampler(findings):
    # 64 rows cycling greedy / top-k 20 / top-k 40 + top-p + min-p / top_k = SHARD_CANDIDATES, each its own seed:
    # every row's kept set lies within the 4 devices' top-64 candidates, so the tokens are the one-device sampler's.
    case = findings["sharded_sampling"]["candidates"]
    assert not case["needs_whole_rows"]
    assert case["candidates"] == case["one_device"]
    assert case["sharded"] == case["one_device"]


@pytest.mark.parametrize("case", ["suppressed", "whole_row_0", "whole_row_1", "whole_row_2", "whole_row_3"])
def test_rows_needing_the_whole_vocabulary_take_the_gathered_path(findings, case):
    # min_tokens' suppressed ids, top-p alone, top_k above the candidates, a penalty, logprobs
    run = findings["sharded_sampling"][case]
    assert run["needs_whole_rows"]
    assert run["sharded"] == run["one_device"]


@pytest.mark.parametrize("tp", ["2", "4"])
def test_seeded_sampling_under_tp_equals_tp1(findings, tp):
    assert findings["llama"][tp]["seeded_token_ids"] == findings["tp1_seeded_token_ids"]


def test_constrained_rows_under_tp_equal_tp1_and_match_their_constraints(findings):
    runs, tp1 = findings["llama"]["4"]["constrained"], findings["tp1_constrained"]
    assert [r["token_ids"] for r in runs] == [r["token_ids"] for r in tp1]
    regex_run, json_run = runs
    assert regex_run["finish_reason"] == json_run["finish_reason"] == "stop"
    assert re.fullmatch(r"[a-e]{3,8}-[0-9]{2}", regex_run["text"]), regex_run["text"]
    numbers = json.loads(json_run["text"])
    assert 1 <= len(numbers) <= 3 and all(isinstance(n, int) and 0 <= n <= 99 for n in numbers), numbers
