"""GGUF files served as stored (cbjax/checkpoint/gguf_q4.py, gguf_q8.py, gguf_params.py): 4-bit, 8-bit and 6-bit
tensors keep their bits and compute what the `gguf` package's own dequantizer says they hold; the model they make computes what the
dequantized float32 import (`cbjax import-gguf` + convert, an independent path) computes."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from engine_helpers import ENGINE_OPTIONS, hf_greedy, random_prompts
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import IQ4_NL, dequantize, quantize
from test_gguf_import import QUANT_TYPES, real_gguf_path, write_tiny_llama_gguf
from test_packed_matmul import forward_logits, model_logits
from tokenizers import Tokenizer

from cbjax import LLM, SamplingParams
from cbjax.checkpoint.convert import convert_checkpoint
from cbjax.checkpoint.gguf_import import GGUF_FILE, import_gguf, write_as_stored_dir
from cbjax.checkpoint.gguf_forms import STORED_FORMS, Form, stored_arrays
from cbjax.checkpoint.gguf_params import _kept_as_stored, gguf_stored_shapes, read_gguf_params
from cbjax.checkpoint.loader import load_model
from cbjax.entrypoints.cli.main import main
from cbjax.entrypoints.demo import PLAIN_PROMPTS
from cbjax.models.config import ModelConfig
from cbjax.plan.accelerators import accelerator
from cbjax.plan.capacity import AS_STORED, load_model_config, plan_capacity
from kernels_cpu.quant4 import dequantize_int4

SMOLLM2_CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct"
# q/k/v and gate/up 4-bit (each fused kernel one form, types mixed inside one), o_proj 4-bit; the rest as before.
AS_STORED_TYPES = {**QUANT_TYPES, "attn_q.weight": Q.Q4_0, "attn_k.weight": Q.Q4_1, "attn_v.weight": Q.Q4_0,
                   "attn_output.weight": Q.Q5_0, "ffn_gate.weight": Q.Q4_1, "ffn_up.weight": Q.Q4_0}

# q/k/v of three forms (4-bit Q4_1, Q5_1 int8 with mins, Q8_0 int8) held in their common int8 form with mins, as
# llama.cpp's K-quant mixes need; IQ4_NL o and gate/up as 4-bit nibbles indexing IQ4's grid (the fused one sharing
# it); Q5_1 down and embedding-head.
MIXED_TYPES = {"token_embd.weight": Q.Q5_1, "attn_q.weight": Q.Q4_1, "attn_k.weight": Q.Q5_1, "attn_v.weight": Q.Q8_0,
               "attn_output.weight": Q.IQ4_NL, "ffn_gate.weight": Q.IQ4_NL, "ffn_up.weight": Q.IQ4_NL,
               "ffn_down.weight": Q.Q5_1}


# Types the gguf package has no quantizer for -> the byte offsets of each block's float16 factors (d, dmin), as
# ggml lays them out (block_q4_K, block_q6_K, ...). Any bytes are a valid block once those are finite.
FACTOR_BYTES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q5_K: (0, 2), Q.Q3_K: (108,), Q.Q2_K: (80, 82), Q.IQ4_NL: (0,),
                Q.IQ4_XS: (0,)}


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, k: int) -> np.ndarray:
    """Random [rows, k] tensor bytes of `qtype`: random bits with small random float16 factors."""
    per_block, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * k // per_block, nbytes), dtype=np.uint8)
    for offset in FACTOR_BYTES[qtype]:
        blocks[:, offset : offset + 2] = rng.uniform(1e-4, 1e-2, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def random_tensor(rng: np.random.Generator, qtype: Q, out: int, k: int) -> np.ndarray:
    """A random [out, k] tensor of `qtype`: the gguf package's quantizer where it has one, else random blocks."""
    if qtype in FACTOR_BYTES:
        return random_blocks(rng, qtype, out, k)
    return quantize(rng.standard_normal((out, k)).astype(np.float32), qtype)


def held_weight(arrays: dict[str, np.ndarray], form: Form) -> np.ndarray:
    """The float64 [in, out] weight that stored_arrays' kernel, scales and mins stand for."""
    if form.bits == 4:
        return dequantize_int4(arrays["kernel"], arrays["scales"], arrays["mins"], arrays.get("grid"))
    weight = arrays["kernel"].astype(np.float64) * np.repeat(arrays["scales"].astype(np.float64), form.group, axis=0)
    return weight + (np.repeat(arrays["mins"].astype(np.float64), form.group, axis=0) if form.mins else 0)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K, Q.Q5_0, Q.Q3_K])
def test_int8_tensors_repack_to_exactly_what_ggufs_dequantizer_reads(qtype):
    rng = np.random.default_rng()
    out, k = 40, 512
    data = random_tensor(rng, qtype, out, k)
    reference = dequantize(data, qtype).reshape(out, k).T  # [in, out], as our kernels are
    order = rng.permutation(out)
    form = STORED_FORMS[qtype]
    arrays = stored_arrays(data, qtype, k, form, order)
    q, scales = arrays["kernel"], arrays["scales"]
    assert set(arrays) == {"kernel", "scales"} and form.bits == 8
    assert q.shape == (k, out) and q.dtype == np.int8 and scales.shape == (k // form.group, out) and scales.dtype == np.float32
    # both are the float32 product of the same q and (d, or d * sc_j formed in float32) scale
    np.testing.assert_array_equal(q.astype(np.float32) * np.repeat(scales, form.group, axis=0), reference[:, order])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_1, Q.Q5_K, Q.Q2_K, Q.IQ4_NL, Q.IQ4_XS])
def test_tensors_with_mins_repack_to_what_ggufs_dequantizer_reads(qtype):
    """4-bit forms (IQ4's with its grid [16] of values the nibbles index, and zero mins) and int8 with mins."""
    rng = np.random.default_rng()
    out, k = 40, 512
    data = random_tensor(rng, qtype, out, k)
    reference = dequantize(data, qtype).reshape(out, k).T.astype(np.float64)  # [in, out], as our kernels are
    order = rng.permutation(out)
    form = STORED_FORMS[qtype]
    arrays = stored_arrays(data, qtype, k, form, order)
    kernel_shape = (k // 2, out) if form.bits == 4 else (k, out)
    assert form.mins and arrays["kernel"].shape == kernel_shape
    assert arrays["scales"].shape == arrays["mins"].shape == (k // form.group, out)
    assert arrays["kernel"].dtype == (np.uint8 if form.bits == 4 else np.int8)
    assert ("grid" in arrays) == (qtype in (Q.IQ4_NL, Q.IQ4_XS)) == form.grid
    # gguf rounds d * q (+ m) in float32; the form is exact in float64
    np.testing.assert_allclose(held_weight(arrays, form), reference[:, order], rtol=2**-23, atol=1e-30)


@pytest.mark.parametrize("qtype,form", [
    (qtype, form) for qtype in (Q.Q4_0, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q3_K, Q.Q2_K, Q.IQ4_XS)
    for form in (Form(8, 16, True), Form(8, 32, True)) if STORED_FORMS[qtype].group % form.group == 0])
def test_a_part_held_in_a_fused_kernels_common_int8_form_is_the_same_weight(qtype, form):
    """A 4-bit or int8 part widened to int8, its groups cut to 16 and its mins zero where it has none: the same
    float64 weight as in its own form (the arrays are the file's integers and factors, moved)."""
    rng = np.random.default_rng()
    out, k = 24, 512
    data = random_tensor(rng, qtype, out, k)
    own, common = (stored_arrays(data, qtype, k, f) for f in (STORED_FORMS[qtype], form))
    assert common["kernel"].dtype == np.int8 and common["mins"].shape == common["scales"].shape == (k // form.group, out)
    np.testing.assert_array_equal(held_weight(common, form), held_weight(own, STORED_FORMS[qtype]))


def test_a_fused_kernel_stays_quantized_if_all_its_parts_do_in_one_form_that_holds_each():
    """q/k/v (and gate/up) become one kernel with one form: a float k_proj makes its q and v dequantized too;
    parts of one form keep it; parts of different forms share int8 in the largest group dividing theirs, with
    mins where any part has them."""
    slots = {"embd": "model.embed_tokens.embedding", "head": "lm_head.kernel", "norm": "model.norm.scale"}
    for layer in range(6):
        slots.update({f"{part}{layer}": f"model.layers.{layer}.{kind}.{part}_proj.kernel"
                      for kind, parts in (("self_attn", "qkvo"), ("mlp", ("gate", "up"))) for part in parts})
    types = {"embd": Q.Q8_0, "head": Q.Q6_K, "norm": Q.F32,
             "q0": Q.Q4_0, "k0": Q.F16, "v0": Q.Q4_K, "o0": Q.Q4_1, "gate0": Q.Q4_K, "up0": Q.Q4_0,
             "q1": Q.Q8_0, "k1": Q.Q8_0, "v1": Q.Q8_0, "o1": Q.Q6_K, "gate1": Q.Q8_0, "up1": Q.Q6_K,
             "q2": Q.Q6_K, "k2": Q.Q6_K, "v2": Q.Q6_K, "o2": Q.Q8_0, "gate2": Q.Q4_0, "up2": Q.Q8_0,
             # llama.cpp's Q4_K_M where 256 does not divide a row: Q5_0 beside Q8_0, both int8 groups of 32
             "q3": Q.Q5_0, "k3": Q.Q5_0, "v3": Q.Q8_0, "o3": Q.Q5_0, "gate3": Q.Q5_0, "up3": Q.Q6_K,
             # its Q5_K_M there: Q5_1 q/k beside a Q8_0 v; a 7B's Q4_K_M: Q4_K q/k beside a Q6_K v
             "q4": Q.Q5_1, "k4": Q.Q5_1, "v4": Q.Q8_0, "o4": Q.Q5_K, "gate4": Q.Q4_K, "up4": Q.Q6_K,
             # its IQ4_XS there: IQ4_NL's grid beside a Q8_0 v is int8 (with IQ4's zero mins), beside itself 4-bit
             "q5": Q.IQ4_NL, "k5": Q.IQ4_NL, "v5": Q.Q8_0, "o5": Q.IQ4_NL, "gate5": Q.IQ4_NL, "up5": Q.IQ4_NL}
    kept = _kept_as_stored(types, slots)
    assert set(kept) == set(types) - {"norm", "q0", "k0", "v0"}
    int8 = lambda group, mins: Form(8, group, mins)  # noqa: E731
    assert kept["o0"] == kept["gate0"] == kept["up0"] == Form(4, 32, True) and kept["gate4"] == int8(16, True)
    assert kept["q1"] == kept["v1"] == int8(32, False) and kept["gate1"] == kept["up1"] == int8(16, False)
    assert kept["q2"] == int8(16, False) and kept["gate2"] == kept["up2"] == int8(32, True)
    assert kept["q3"] == kept["v3"] == kept["o3"] == int8(32, False) and kept["up3"] == int8(16, False)
    assert kept["q4"] == kept["v4"] == kept["o4"] == int8(32, True) and kept["up4"] == int8(16, True)
    assert kept["head"] == int8(16, False) and kept["embd"] == int8(32, False)
    assert kept["q5"] == kept["v5"] == int8(32, True) and kept["o5"] == kept["gate5"] == Form(4, 32, True, grid=True)


def stored_and_imported(root: Path, quant_types: dict) -> tuple[Path, Path]:
    """A tiny GGUF of `quant_types` written under `root`: (its as-stored dir, the float checkpoint imported and
    converted from the same file)."""
    write_tiny_llama_gguf(root / "tiny.gguf", quant_types=quant_types)
    return (write_as_stored_dir(root / "tiny.gguf", root / "stored"),
            convert_checkpoint(import_gguf(root / "tiny.gguf", root / "hf"), root / "float"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return stored_and_imported(tmp_path_factory.mktemp("as_stored"), AS_STORED_TYPES)


@pytest.fixture(scope="module")
def tiny_mixed_gguf(tmp_path_factory):
    return stored_and_imported(tmp_path_factory.mktemp("as_stored_mixed"), MIXED_TYPES)


def assert_the_float_imports_logits(stored: Path, imported: Path, packed: nnx.Module) -> None:
    """The model loaded as stored, packed for the C++ kernels (`packed`) and unpacked (the jnp path: GPUs,
    cpu_packed_weights=False), gives the float32 import's logits over 30 random tokens."""
    unpacked, _ = load_model(stored, fused_projections=True)
    reference, _ = load_model(imported, pack_for_cpu=True, fused_projections=True)
    tokens = list(np.random.default_rng(3).integers(3, 250, 30))
    want = forward_logits(reference, tokens, "cpp")
    for model in (packed, unpacked):
        got = forward_logits(model, tokens, "cpp")
        # float32 sums in another order, through layers of N(0, 1) weights: ~3e-5 of the largest logit; a wrong
        # nibble, group or row order is off by whole units
        np.testing.assert_allclose(got, want, atol=5e-5 * np.abs(want).max(), rtol=0)
        assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the C++ kernels are XLA:CPU custom calls")
def test_tiny_gguf_as_stored_gives_the_float_imports_logits(tiny_gguf, caplog):
    stored, imported = tiny_gguf
    with caplog.at_level(logging.INFO, logger="cbjax.checkpoint.gguf_params"):
        packed, _ = load_model(stored, pack_for_cpu=True, fused_projections=True)
    assert ("15 tensors kept quantized (3 Q8_0, 6 Q4_0, 4 Q4_1, 2 Q5_0); dequantized to float32 at load: "
            "5 F32 (output_norm.weight, ") in caplog.text
    layer = packed.model.layers[0]
    assert layer.self_attn.qkv_proj.kernel[...].dtype == np.uint8 and layer.mlp.down_proj.kernel[...].dtype == np.int8
    assert layer.self_attn.o_proj.kernel[...].dtype == np.int8  # Q5_0: int8 groups of 32
    # 4-bit scales and mins packed by panel beside their nibble panels (linear.pack_scales_beside), int8 scales not
    qkv = layer.self_attn.qkv_proj
    assert qkv.scales[...].shape == qkv.mins[...].shape == (qkv.kernel.shape[0], 2 * qkv.kernel.shape[1] // 32, 32)
    assert layer.mlp.down_proj.scales[...].ndim == 2
    assert packed.model.embed_tokens.embedding[...].dtype == np.int8  # the tied head's kernel, in int8 panels
    assert_the_float_imports_logits(stored, imported, packed)


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the C++ kernels are XLA:CPU custom calls")
def test_tiny_gguf_with_mins_grids_and_mixed_fused_kernels_as_stored_gives_the_float_imports_logits(tiny_mixed_gguf, caplog):
    """Every projection and the embedding-head of MIXED_TYPES kept as stored: Q5_1 as int8 with mins, q/k/v (parts
    of three forms) in one int8 form with mins, IQ4_NL as nibbles with IQ4's grid."""
    stored, imported = tiny_mixed_gguf
    with caplog.at_level(logging.INFO, logger="cbjax.checkpoint.gguf_params"):
        packed, _ = load_model(stored, pack_for_cpu=True, fused_projections=True)
    assert "15 tensors kept quantized (" in caplog.text and "dequantized to float32 at load: 5 F32 (" in caplog.text
    assert all(f"{count} {kind}" in caplog.text for kind, count in (("Q5_1", 5), ("Q4_1", 2), ("Q8_0", 2), ("IQ4_NL", 6)))
    for layer in packed.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            assert module.kernel[...].dtype == np.int8 and module.mins[...].shape == module.scales[...].shape
        for module in (layer.self_attn.o_proj, layer.mlp.gate_up_proj):
            assert module.kernel[...].dtype == np.uint8
            np.testing.assert_array_equal(module.grid[...], np.array(IQ4_NL.kvalues, np.float32))
    embed = packed.model.embed_tokens
    assert embed.embedding[...].dtype == np.int8 and embed.mins[...].shape == embed.scales[...].shape
    assert_the_float_imports_logits(stored, imported, packed)


def test_llm_serves_a_gguf_file_with_its_own_tokenizer_as_transformers_serves_its_import(
        tiny_gguf, tmp_path, monkeypatch):
    from kernels_cpu.build import cache_dir as kernel_cache

    monkeypatch.setenv("CBJAX_KERNEL_CACHE", str(kernel_cache()))  # the kernels already built, beside a fresh model cache
    monkeypatch.setenv("CBJAX_CACHE_DIR", str(tmp_path))
    gguf_file = tiny_gguf[0] / "model.gguf"
    llm = LLM(str(gguf_file.resolve()), **ENGINE_OPTIONS)
    hf_dir = gguf_file.resolve().parent / "hf"
    text = "Once upon a time 12345"
    prompts = [Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text).ids, *random_prompts(8, [5, 40], vocab=250)]
    outputs = llm.generate([text, *({"prompt_token_ids": p} for p in prompts[1:])],
                           SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert outputs[0].prompt_token_ids == prompts[0]  # the GGUF's tokenizer, rebuilt as the importer does
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(hf_dir, p, 8) for p in prompts]


@pytest.mark.parametrize("files", ["tiny_gguf", "tiny_mixed_gguf"])
def test_plan_counts_a_gguf_file_as_the_loader_holds_it(files, request, capsys):
    """`cbjax plan --config FILE.gguf`: the config the engine serves the file with, and the bytes of what the
    loader makes of its tensors (kept as stored, the rest in dtype; mins and fused kernels' common forms in the
    mixed file), from the tensor list alone: at one device exactly the loaded parameters' bytes; under tensor
    parallelism (embedding and head dequantized) the same names, shapes and dtypes as the loader's."""
    tiny_gguf = request.getfixturevalue(files)
    gguf_file = tiny_gguf[0] / GGUF_FILE
    name, config = load_model_config(str(gguf_file))
    assert config == ModelConfig.from_dir(tiny_gguf[0])  # the as-stored directory's config.json
    plan = plan_capacity(name, config, accelerator("h100"), 1, dtype="float32", gguf=gguf_file)
    loaded = read_gguf_params(gguf_file, config, "float32")
    assert plan.quantization == AS_STORED
    assert plan.weight_bytes_per_device == sum(array.nbytes for array in loaded.values())
    for tensor_parallel in (False, True):
        shapes = gguf_stored_shapes(gguf_file, config, "float32", tensor_parallel)
        params = loaded if not tensor_parallel else read_gguf_params(gguf_file, config, "float32", tensor_parallel=True)
        want = {name: (array.shape, array.dtype) for name, array in params.items()}
        assert {name: (tuple(spec.shape), spec.dtype) for name, spec in shapes.items()} == want
    main(["plan", "--config", str(gguf_file), "--device", "h100", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "weights float32 (the GGUF file's quantized tensors as stored)" in out
    assert f"({plan.weight_bytes_per_device:,} bytes)" in out
    with pytest.raises(ValueError, match="already quantized; quantization='int4' cannot quantize them again"):
        plan_capacity(name, config, accelerator("h100"), 1, quantization="int4", gguf=gguf_file)
    with pytest.raises(SystemExit, match=f"would lower the float model .* use --model {gguf_file}"):
        main(["lower", "--config", str(gguf_file)])


@pytest.mark.parametrize("files", ["tiny_gguf", "tiny_mixed_gguf"])
def test_every_step_of_a_gguf_file_as_stored_lowers_for_cuda(files, request, capsys):
    """On a GPU the file's quantized kernels run the jnp products (int8 with group scales and mins, 4-bit): each
    bucket's step lowers for CUDA with them, without a GPU."""
    gguf_file = request.getfixturevalue(files)[0] / GGUF_FILE
    main(["lower", "--platform", "cuda", "--backend", "pallas", "--model", str(gguf_file), "--max-num-seqs", "4",
          "--max-model-len", "64", "--max-num-batched-tokens", "32", "--block-size", "16", "--num-kv-blocks", "40"])
    assert "lowered 3/3 steps for cuda with backend pallas" in capsys.readouterr().out


def test_a_gguf_model_is_not_quantized_again(tiny_gguf):
    with pytest.raises(ValueError, match="already quantized; quantization='int8' cannot quantize them again"):
        load_model(tiny_gguf[0], quantization="int8")


@pytest.mark.slow
@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the C++ kernels are XLA:CPU custom calls")
def test_smollm2_q4_1_as_stored_computes_its_float32_import():
    """The built-in model's own file: the engine serving it as stored continues 8 prompts greedily for 64
    tokens, and at every one of those positions the dequantized float32 import (scripts/fetch_model.sh:
    import-gguf + convert) picks the same token (one forward pass each), so its greedy continuations are the
    same; and the two models' logits agree to float32 accumulation."""
    if real_gguf_path() is None or not (SMOLLM2_CHECKPOINT / "params").is_dir():
        pytest.skip("SmolLM2 GGUF or its converted checkpoint missing (scripts/fetch_model.sh)")
    llm = LLM(str(real_gguf_path()), **ENGINE_OPTIONS)
    outputs = llm.generate(PLAIN_PROMPTS[:8], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                           use_tqdm=False)
    reference, _ = load_model(SMOLLM2_CHECKPOINT, pack_for_cpu=True, fused_projections=True)
    runner = llm.llm_engine.runner
    as_stored = nnx.merge(runner.graphdef, jax.tree_util.tree_unflatten(runner._state_treedef, runner.weights))
    tokens = list(outputs[0].prompt_token_ids) + list(outputs[0].outputs[0].token_ids)[:24]  # 32: forward_logits' pool
    want = forward_logits(reference, tokens, "cpp")
    np.testing.assert_allclose(forward_logits(as_stored, tokens, "cpp"), want, atol=2e-5 * np.abs(want).max(), rtol=0)
    logits = nnx.jit(model_logits, static_argnums=2)
    agreeing = 0
    for output in outputs:  # padded to one length: one compile; causal, so the padding changes no earlier logit
        tokens = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)
        picks = np.asarray(logits(reference, jnp.array(tokens + [0] * (96 - len(tokens))), "cpp"))[
            len(output.prompt_token_ids) - 1 : len(tokens) - 1].argmax(-1)
        agreeing += list(picks) == list(output.outputs[0].token_ids)
    assert agreeing >= 0.95 * len(outputs), f"{agreeing} of {len(outputs)} continuations agree"


def test_smollm2_embedding_is_kept_int8_and_its_rows_are_ggufs_own(tmp_path):
    """The built-in file's Q8_0 token embedding (also its tied LM head) stays int8: its gathered rows are the
    gguf package's dequantized rows exactly, and it takes 78 MiB less than in float32 (108 MiB -> 30)."""
    if real_gguf_path() is None:
        pytest.skip("SmolLM2 GGUF missing (scripts/fetch_model.sh)")
    model, config = load_model(write_as_stored_dir(real_gguf_path(), tmp_path / "stored"), pack_for_cpu=True,
                               fused_projections=True)
    table = next(t for t in GGUFReader(real_gguf_path()).tensors if t.name == "token_embd.weight")
    assert table.tensor_type == Q.Q8_0
    token_ids = np.array([0, 1, 31, 32, 1000, config.vocab_size - 1])
    rows = dequantize(table.data[token_ids], Q.Q8_0)
    np.testing.assert_array_equal(np.asarray(model.embed(jnp.asarray(token_ids))), rows)
    embed = model.model.embed_tokens
    stored = embed.embedding[...].nbytes + embed.scales[...].nbytes  # int8 q, a float32 scale per 32 values
    assert embed.embedding[...].dtype == np.int8 and stored == config.vocab_size * config.hidden_size * (1 + 4 / 32)
    assert model.lm_head is None and model.tied_head is None  # the head has no copy of its own
