"""Turn a llama-architecture GGUF file into a Hugging Face checkpoint directory.

Tensor names come from the model registry's GGUF names (cbjax.models.registry.LLAMA_GGUF).

The directory holds what `transformers` and `cbjax convert` read:
  model.safetensors          float32, dequantized, HF tensor names and Q/K row order
                             (sharded with an index past `max_shard_bytes`)
  config.json                LlamaForCausalLM, transformers-4.x key names
  generation_config.json     bos / eos ids
  tokenizer.json             byte-level BPE rebuilt from the GGUF vocabulary and merges
  tokenizer_config.json      special tokens, add_bos_token, chat_template

Weights are dequantized and written one tensor at a time, so memory stays
bounded by the largest tensor, not the model.

`write_as_stored_dir` writes the same directory without weights, with a link to the file: the loader
then reads its tensors as stored (cbjax/checkpoint/gguf_params.py), `LLM(model="file.gguf")`'s way.
"""

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tqdm import tqdm

from cbjax.models.registry import ARCHITECTURES, GGUFNames, gguf_architecture

# Hugging Face's default shard size ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED are added but not special.
_CONTROL, _USER_DEFINED = 3, 4

# How llama.cpp splits text before BPE, per `tokenizer.ggml.pre`, as `tokenizers` pre-tokenizers.
_GPT2_PRE = ("default", "gpt2", "mpt", "olmo")
# llama.cpp isolates every digit (`\p{N}`) first, then applies GPT-2's split to the rest.
_DIGITS_THEN_GPT2_PRE = ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# The link to the GGUF file in a directory that serves its weights as stored (write_as_stored_dir).
GGUF_FILE = "model.gguf"


def import_gguf(gguf_path: str | Path, out_dir: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write the Hugging Face directory for `gguf_path` into `out_dir` and return `out_dir`."""
    reader = GGUFReader(gguf_path)
    config, names = _write_description(reader, gguf_path, out_dir)
    _write_weights(reader, config, names, Path(out_dir), max_shard_bytes)
    return Path(out_dir)


def write_as_stored_dir(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write `out_dir` for serving `gguf_path` as stored: config.json, generation_config.json and the
    tokenizer files from its metadata, and GGUF_FILE, a link to the file, whose tensors the loader reads
    (cbjax/checkpoint/gguf_params.py); no weights are written."""
    _write_description(GGUFReader(gguf_path), gguf_path, out_dir)
    (Path(out_dir) / GGUF_FILE).symlink_to(Path(gguf_path).resolve())
    return Path(out_dir)


def _write_description(reader: GGUFReader, gguf_path: str | Path, out_dir: str | Path) -> tuple[dict, GGUFNames]:
    """config.json, generation_config.json and the tokenizer files into `out_dir`; the config and tensor names."""
    # Everything that can refuse the file runs before the first byte is written.
    metadata, config, names = _description(reader, gguf_path)
    tokenizer = build_tokenizer(metadata)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(metadata))
    _write_tokenizer_files(tokenizer, metadata, out_dir)
    return config, names


def gguf_config(gguf_path: str | Path) -> dict:
    """The Hugging Face config of `gguf_path` as write_as_stored_dir writes it, from its metadata and tensor
    names alone (no tensor data is read; refused as the importer refuses the file)."""
    return _description(GGUFReader(gguf_path), gguf_path)[1]


def _description(reader: GGUFReader, gguf_path: str | Path) -> tuple[dict, dict, GGUFNames]:
    """The file's metadata, its Hugging Face config and its architecture's tensor names; refuses an
    architecture or a tensor list the importer cannot read, naming what it can."""
    metadata = read_metadata(reader)
    names = gguf_names(metadata, gguf_path)
    config = llama_config(metadata, tensor_names={t.name for t in reader.tensors})
    check_tensors([tensor.name for tensor in reader.tensors], config["num_hidden_layers"], names)
    return metadata, config, names


def import_gguf_tokenizer(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write only tokenizer.json and tokenizer_config.json for `gguf_path` (no weights)."""
    metadata = read_metadata(GGUFReader(gguf_path))
    tokenizer = build_tokenizer(metadata)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tokenizer_files(tokenizer, metadata, out_dir)
    return out_dir


def read_metadata(reader: GGUFReader) -> dict:
    """Every key-value field of the file as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}


def gguf_names(metadata: dict, gguf_path: str | Path) -> GGUFNames:
    """The tensor names of the file's architecture, from the model registry entry that has GGUF names for it."""
    architecture = metadata.get("general.architecture")
    entry = gguf_architecture(architecture)
    if entry is None:
        supported = ", ".join(repr(e.gguf.architecture) for e in ARCHITECTURES.values() if e.gguf)
        raise ValueError(
            f"{gguf_path} has general.architecture={architecture!r}; the GGUF importer supports only {supported}; "
            "convert the original Hugging Face checkpoint with `cbjax convert` instead"
        )
    return entry.gguf


# --- config ------------------------------------------------------------------------------------------------


def llama_config(metadata: dict, tensor_names: set[str]) -> dict:
    """config.json for LlamaForCausalLM from the `llama.*` metadata keys."""
    hidden_size = _int_key(metadata, "llama.embedding_length")
    num_heads = _int_key(metadata, "llama.attention.head_count")
    head_dim = metadata.get("llama.attention.key_length", hidden_size // num_heads)
    rope_dim = metadata.get("llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"llama.rope.dimension_count is {rope_dim} but head_dim is {head_dim}; partial rotary embeddings "
            "are not Llama; import the model from its Hugging Face checkpoint instead"
        )
    rope_scaling = metadata.get("llama.rope.scaling.type", "none")
    if rope_scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"this GGUF uses RoPE scaling (llama.rope.scaling.type={rope_scaling!r}, rope_freqs tensor: "
            f"{'rope_freqs.weight' in tensor_names}); only unscaled RoPE is supported; "
            "import the model from its Hugging Face checkpoint instead"
        )
    vocab_size = metadata.get("llama.vocab_size", len(metadata["tokenizer.ggml.tokens"]))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": _int_key(metadata, "llama.feed_forward_length"),
        "num_hidden_layers": _int_key(metadata, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _int_key(metadata, "llama.attention.head_count_kv", default=num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": metadata["llama.attention.layer_norm_rms_epsilon"],
        "rope_theta": metadata.get("llama.rope.freq_base", 10000.0),
        "rope_scaling": None,
        "max_position_embeddings": _int_key(metadata, "llama.context_length"),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = metadata.get(f"tokenizer.ggml.{key.replace('pad_', 'padding_')}")
    return config


def generation_config(metadata: dict) -> dict:
    """generation_config.json: every id llama.cpp stops on (eos, end-of-turn, end-of-message)."""
    eos_ids = [
        metadata[key]
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if key in metadata
    ]
    eos_ids = list(dict.fromkeys(eos_ids))
    config = {"bos_token_id": metadata.get("tokenizer.ggml.bos_token_id")}
    config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "tokenizer.ggml.padding_token_id" in metadata:
        config["pad_token_id"] = metadata["tokenizer.ggml.padding_token_id"]
    return config


def _int_key(metadata: dict, key: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if not isinstance(value, int):
        raise ValueError(
            f"GGUF key {key} is {value!r}; the importer needs one integer for all layers "
            "(per-layer values are not Llama)"
        )
    return value


# --- weights -----------------------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str, names: GGUFNames) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if gguf_name in names.global_tensors:
        return names.global_tensors[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names.layer_tensors:
        return f"model.layers.{parts[1]}.{names.layer_tensors[parts[2]]}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Llama counterpart; known names are {sorted(names.global_tensors)} "
        f"and blk.N.{{{', '.join(names.layer_tensors)}}}; this file is not a plain Llama model"
    )


def check_tensors(gguf_names: list[str], num_layers: int, names: GGUFNames) -> None:
    """Every tensor has a Llama name, and every tensor a Llama model needs is there."""
    present = {hf_tensor_name(name, names) for name in gguf_names}
    needed = {names.global_tensors[name] for name in names.required_global}
    needed |= {f"model.layers.{layer}.{name}" for layer in range(num_layers) for name in names.layer_tensors.values()}
    missing = sorted(needed - present)
    if missing:
        raise ValueError(
            f"the GGUF file lacks {len(missing)} tensors a {num_layers}-layer Llama needs, e.g. {missing[:3]}; "
            "the file is incomplete or not a plain Llama model"
        )


def rope_heads(gguf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """The heads whose rows llama.cpp interleaved in a Q or K projection (None for any other tensor)."""
    return {"attn_q.weight": num_heads, "attn_k.weight": num_kv_heads}.get(gguf_name.split(".", 2)[-1])


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (it rotates pairs (2i, 2i+1); HF rotates halves)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_weights(reader: GGUFReader, config: dict, gguf: GGUFNames, out_dir: Path, max_shard_bytes: int) -> None:
    # GGUF lists dimensions fastest-first; reversed, they are the HF [out, in] shape that dequantize returns.
    names = [hf_tensor_name(tensor.name, gguf) for tensor in reader.tensors]
    shapes = [tuple(int(d) for d in reversed(tensor.shape)) for tensor in reader.tensors]
    shards = _plan_shards([4 * math.prod(shape) for shape in shapes], max_shard_bytes)
    progress = tqdm(total=len(names), desc="dequantizing GGUF tensors", unit="tensor")

    def hf_weights(shard: range) -> Iterator[np.ndarray]:
        for index in shard:
            tensor = reader.tensors[index]
            weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shapes[index])
            num_heads = rope_heads(tensor.name, config["num_attention_heads"], config["num_key_value_heads"])
            yield weight if num_heads is None else unpermute_rope_rows(weight, num_heads)
            progress.update()

    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(out_dir / file_name, [(names[i], shapes[i]) for i in shard], hf_weights(shard))
        weight_map.update({names[i]: file_name for i in shard})
    progress.close()
    if len(shards) > 1:
        total_size = sum(4 * math.prod(shape) for shape in shapes)
        _write_json(out_dir / "model.safetensors.index.json", {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def _plan_shards(sizes: list[int], max_shard_bytes: int) -> list[range]:
    """Consecutive tensor ranges of at most `max_shard_bytes` each (a bigger tensor gets a shard alone)."""
    shards, start, size = [], 0, 0
    for index, nbytes in enumerate(sizes):
        if index > start and size + nbytes > max_shard_bytes:
            shards.append(range(start, index))
            start, size = index, 0
        size += nbytes
    shards.append(range(start, len(sizes)))
    return shards


def _write_safetensors(path: Path, entries: list[tuple[str, tuple]], arrays: Iterator[np.ndarray]) -> None:
    """Stream float32 tensors into one safetensors file: the header is known from the shapes up front."""
    header, offset = {}, 0
    for name, shape in entries:
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(header_bytes)))
        file.write(header_bytes)
        for (name, shape), array in zip(entries, arrays, strict=True):
            assert array.shape == shape, f"{name}: dequantized to {array.shape}, header says {shape}"
            file.write(np.ascontiguousarray(array, dtype="<f4").data)


# --- tokenizer ---------------------------------------------------------------------------------------------


def build_tokenizer(metadata: dict) -> Tokenizer:
    """The byte-level BPE tokenizer the GGUF metadata describes, as a `tokenizers.Tokenizer`."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model is {model!r}; the GGUF importer rebuilds only byte-level BPE ('gpt2') "
            "tokenizers; copy tokenizer.json from the original Hugging Face checkpoint instead"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    byte_spelling = _byte_to_unicode()
    alphabet = set(byte_spelling.values())
    # llama.cpp keeps a few tokens as raw text; the HF vocabulary spells every token in the byte alphabet.
    vocab = {
        token if set(token) <= alphabet else "".join(byte_spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(metadata)

    token_types = metadata.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    named_ids = {metadata[f"tokenizer.ggml.{key}"] for key in _NAMED_SPECIAL_IDS.values() if f"tokenizer.ggml.{key}" in metadata}
    # A control token outside the byte alphabet is a llama.cpp mislabel (transformers skips it too).
    special = [
        AddedToken(token, normalized=False, special=True)
        for index, (token, token_type) in enumerate(zip(tokens, token_types))
        if (token_type == _CONTROL or index in named_ids) and set(token) <= alphabet
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == _USER_DEFINED and set(token) <= alphabet
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user_defined)
    return tokenizer


_NAMED_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def add_bos_token(metadata: dict) -> bool:
    """The file's own flag; without one, llama.cpp adds BOS only for sentencepiece ('llama') vocabularies."""
    return bool(metadata.get("tokenizer.ggml.add_bos_token", metadata.get("tokenizer.ggml.model") == "llama"))


def tokenizer_config(metadata: dict) -> dict:
    tokens = metadata["tokenizer.ggml.tokens"]
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in _NAMED_SPECIAL_IDS.items():
        if f"tokenizer.ggml.{key}" in metadata:
            config[name] = tokens[metadata[f"tokenizer.ggml.{key}"]]
    config["add_bos_token"] = add_bos_token(metadata)
    config["add_eos_token"] = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    config["clean_up_tokenization_spaces"] = False
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    supported = sorted(_GPT2_PRE + _DIGITS_THEN_GPT2_PRE + _LLAMA3_PRE)
    raise ValueError(
        f"tokenizer.ggml.pre is {pre!r}; the importer knows {supported}; copy tokenizer.json from the "
        "original Hugging Face checkpoint instead"
    )


def _post_processor(metadata: dict) -> processors.TemplateProcessing:
    """Add BOS / EOS around every encoding the way transformers' `update_post_processor` does."""
    tokens = metadata["tokenizer.ggml.tokens"]
    bos_id, eos_id = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = add_bos_token(metadata) and bos_id is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None

    def template(sequence: str, type_id: int) -> list[str]:
        bos = [f"{tokens[bos_id]}:{type_id}"] if add_bos else []
        eos = [f"{tokens[eos_id]}:{type_id}"] if add_eos else []
        return bos + [f"${sequence}:{type_id}"] + eos

    special_tokens = [(tokens[bos_id], bos_id)] * add_bos + [(tokens[eos_id], eos_id)] * add_eos
    return processors.TemplateProcessing(
        single=template("A", 0), pair=template("A", 0) + template("B", 1), special_tokens=special_tokens
    )


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible spelling of bytes as printable characters (byte-level BPE's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    spelling = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in spelling)
    spelling.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return spelling


def _write_tokenizer_files(tokenizer: Tokenizer, metadata: dict, out_dir: Path) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(metadata))


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
