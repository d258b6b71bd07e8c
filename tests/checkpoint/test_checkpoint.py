"""HF -> orbax conversion and loading: tensors arrive unchanged, and every mismatch is named."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from cbjax.checkpoint import convert_checkpoint, load_model
from cbjax.models.config import ModelConfig, RopeScaling
from helpers_hf import make_tiny_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """Qwen2 has every kind of tensor: embedding, untied head, q/k/v biases, norms."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("hf"), "qwen2", name="Tiny-Qwen2")


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    return convert_checkpoint(hf_dir, tmp_path_factory.mktemp("ckpt") / "tiny")


def hf_tensors(hf_dir) -> dict[str, np.ndarray]:
    tensors = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def model_params(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, path)): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_params_equal_hf(model, hf_dir, dtype=np.float32):
    """Our params are HF's tensors: Linear weights transposed, the embedding renamed, the rest as is."""
    params = model_params(model)
    expected = {}
    for name, tensor in hf_tensors(hf_dir).items():
        if name == "model.embed_tokens.weight":
            expected["model.embed_tokens.embedding"] = tensor
        elif name.endswith("_proj.weight") or name == "lm_head.weight":
            expected[name.removesuffix("weight") + "kernel"] = tensor.T
        else:
            expected[name] = tensor
    assert sorted(params) == sorted(expected)
    for name, tensor in expected.items():
        assert params[name].dtype == dtype, name
        np.testing.assert_array_equal(params[name], tensor.astype(dtype), err_msg=name)


def edit_config(ckpt_dir, tmp_path, **changes):
    """A copy of ckpt_dir whose config.json has `changes` applied."""
    copy = tmp_path / "edited"
    shutil.copytree(ckpt_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_round_trip_params_equal_hf_tensors(converted, hf_dir):
    model, config = load_model(converted)
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias
    assert_params_equal_hf(model, hf_dir)


def test_conversion_copies_config_and_generation_files(converted, hf_dir):
    assert (converted / "params").is_dir()
    assert (converted / "generation_config.json").read_text() == (hf_dir / "generation_config.json").read_text()
    assert json.loads((converted / "config.json").read_text())["dtype"] == "float32"


def test_tokenizer_files_are_copied_and_default_out_dir_is_lowercased_name(hf_dir, tmp_path, monkeypatch):
    src = tmp_path / "WithTokenizer"
    shutil.copytree(hf_dir, src)
    (src / "tokenizer.json").write_text('{"model": "tiny"}')
    (src / "chat_template.jinja").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)
    out = convert_checkpoint(src)
    assert out == tmp_path.joinpath("checkpoints", "withtokenizer").relative_to(tmp_path)
    assert (tmp_path / out / "tokenizer.json").read_text() == '{"model": "tiny"}'
    assert (tmp_path / out / "chat_template.jinja").read_text() == "{{ messages }}"


def test_sharded_safetensors_convert_like_single_file(tmp_path):
    sharded = make_tiny_hf_model(tmp_path, "llama", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    model, _ = load_model(convert_checkpoint(sharded, tmp_path / "out"))
    assert_params_equal_hf(model, sharded)


def test_bfloat16_conversion_writes_and_loads_bfloat16(hf_dir, tmp_path):
    out = convert_checkpoint(hf_dir, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model, config = load_model(out)
    assert config.dtype == "bfloat16"
    assert_params_equal_hf(model, hf_dir, dtype=jnp.bfloat16)


def test_load_casts_only_when_dtype_is_requested(converted, hf_dir, tmp_path):
    mislabelled = edit_config(converted, tmp_path, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"model\.norm\.weight has dtype float32; the model expects bfloat16"):
        load_model(mislabelled)
    model, _ = load_model(mislabelled, dtype="float16")
    assert_params_equal_hf(model, hf_dir, dtype=np.float16)


def test_loading_an_hf_directory_directly(hf_dir):
    model, _ = load_model(hf_dir)
    assert_params_equal_hf(model, hf_dir)


def test_missing_tensor_is_named(converted, tmp_path):
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.2\.mlp\.up_proj\.kernel"):
        load_model(edit_config(converted, tmp_path, num_hidden_layers=3))


def test_extra_tensor_is_named(converted, tmp_path):
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.1\.self_attn\.q_proj\.bias"):
        load_model(edit_config(converted, tmp_path, num_hidden_layers=1))


def test_wrong_shape_is_named_with_both_shapes(converted, tmp_path):
    with pytest.raises(ValueError, match=r"gate_proj\.kernel has shape \(64, 128\); the model expects \(64, 96\)"):
        load_model(edit_config(converted, tmp_path, intermediate_size=96))


def test_hf_tensor_missing_from_safetensors_is_named_at_conversion(hf_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.bias"):
        convert_checkpoint(broken, tmp_path / "out")


def test_unsupported_architecture_lists_supported(converted, tmp_path):
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel is not supported; supported: LlamaForCausalLM"):
        load_model(edit_config(converted, tmp_path, architectures=["GPT2LMHeadModel"]))


def test_pytorch_bin_only_checkpoint_asks_for_safetensors(hf_dir, tmp_path):
    bin_only = tmp_path / "bin-only"
    bin_only.mkdir()
    shutil.copy(hf_dir / "config.json", bin_only)
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"safetensors only.*save_pretrained"):
        convert_checkpoint(bin_only, tmp_path / "out")


LLAMA3_PARAMS = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_transformers_4x_and_5x_config_styles_parse_the_same():
    v5 = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, dtype="bfloat16",
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **LLAMA3_PARAMS),
    ).to_dict()
    v4 = {key: value for key, value in v5.items() if key not in ("rope_parameters", "dtype")}
    v4.update(rope_theta=500000.0, torch_dtype="bfloat16", rope_scaling=dict(type="llama3", **LLAMA3_PARAMS))
    assert "rope_parameters" in v5 and "dtype" in v5
    parsed = ModelConfig.from_hf_config(v5)
    assert parsed == ModelConfig.from_hf_config(v4)
    assert parsed.rope_theta == 500000.0 and parsed.dtype == "bfloat16"
    assert parsed.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), r"rope_type='yarn'.*llama3"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu'.*'silu'"),
        (dict(num_key_value_heads=3), r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ],
)
def test_unsupported_config_options_are_named(changes, message):
    hf = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_attention_heads=4).to_dict()
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**hf, **changes})


def test_mistral_window_longer_than_context_is_accepted():
    hf = transformers.MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=4096,
                                    max_position_embeddings=4096).to_dict()
    parsed = ModelConfig.from_hf_config(hf)
    assert parsed.architecture == "MistralForCausalLM" and parsed.sliding_windows == ()  # it never masks: full attention


@pytest.mark.parametrize(("config", "windows"), [
    (dict(architectures=["MistralForCausalLM"], sliding_window=64), (64, 64, 64)),  # Mistral: every layer
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=True, max_window_layers=1),
     (None, 64, 64)),  # 4.x Qwen2: from max_window_layers on
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=False), ()),
    (dict(architectures=["Qwen3ForCausalLM"], sliding_window=64,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"]), (64, None, 64)),  # 5.x layer_types
])
def test_each_layers_sliding_window_is_read_as_transformers_applies_it(config, windows):
    hf = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=3,
                                  max_position_embeddings=256).to_dict()
    hf.pop("layer_types", None)
    assert ModelConfig.from_hf_config({**hf, **config}).sliding_windows == windows
