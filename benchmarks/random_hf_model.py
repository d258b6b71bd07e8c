"""Write a Hugging Face-format Llama directory with random weights and a real tokenizer.

    python benchmarks/random_hf_model.py --shape llama-3.2-1b --tokenizer-dir downloads/smollm2-135m-instruct-hf \
        --out /tmp/random-1b

For engine runs where no trained checkpoint of the wanted size can be brought (the GPU machine has
no network and a 64 MiB upload): the step costs of a model depend on its shapes, not its values.
The vocabulary is the tokenizer's, so prompts and outputs detokenize. `cbjax bench throughput
--model OUT` converts the directory on first use (cbjax/checkpoint/resolve.py). With --fp8 the decoder
projections are written as an fp8 checkpoint holds them (e4m3, a scale per tensor beside each, vLLM's
quant_method "fp8"), which the engine serves from the directory as stored (cbjax/checkpoint/fp8_checkpoint.py).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

SHAPES = {
    # Llama-3.2-1B's layer shapes (its tied 128k vocabulary replaced by the tokenizer's).
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    # SmolLM2-135M's shapes: the model the CPU benchmarks use.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64),
}
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}  # weight scales per tensor
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def llama_config(shape: dict, vocab_size: int, tokenizer_config: dict) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab_size,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, hidden_act="silu", torch_dtype="bfloat16",
        bos_token_id=tokenizer_config.get("bos_token_id", 1), eos_token_id=tokenizer_config.get("eos_token_id", 2),
        **shape,
    )


def random_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """float16 weights with std 0.02 and unit norms: finite activations through every layer."""
    rng = np.random.default_rng(seed)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], h), "model.norm.weight": np.ones(h, np.float16)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(i, h), p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
            p + "input_layernorm.weight": np.ones(h, np.float16), p + "post_attention_layernorm.weight": np.ones(h, np.float16),
        }
    return weights


def as_fp8(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`weights` with each decoder projection as e4m3 codes and its `..._scale` (largest |w| / 448) beside."""
    stored = {}
    for name, weight in weights.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            weight = weight.astype(np.float32)
            scale = np.float32(np.abs(weight).max() / 448)
            stored[name + "_scale"] = np.array([scale], np.float32)
            weight = (weight / scale).astype(ml_dtypes.float8_e4m3fn)
        stored[name] = weight
    return stored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--tokenizer-dir", type=pathlib.Path, required=True, help="a Hugging Face dir with tokenizer.json")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8", action="store_true", help="decoder projections fp8 (e4m3, a scale per tensor)")
    args = parser.parse_args(argv)

    tokenizer = json.loads((args.tokenizer_dir / "tokenizer.json").read_text())
    ids = [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer.get("added_tokens", []))]
    vocab_size = max(ids) + 1
    vocab_size = -(-vocab_size // 64) * 64  # padded like most checkpoints' embedding tables
    source_config = json.loads((args.tokenizer_dir / "config.json").read_text()) if (args.tokenizer_dir / "config.json").exists() else {}
    config = llama_config(SHAPES[args.shape], vocab_size, source_config)
    if args.fp8:
        config["quantization_config"] = FP8_CONFIG
    args.out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (args.tokenizer_dir / name).exists():
            shutil.copy(args.tokenizer_dir / name, args.out / name)
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    weights = random_weights(config, args.seed)
    save_file(as_fp8(weights) if args.fp8 else weights, str(args.out / "model.safetensors"))
    print(f"wrote {args.out}: {args.shape} shapes, vocab {vocab_size}{', fp8 projections' if args.fp8 else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
