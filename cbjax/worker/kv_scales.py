"""fp8 KV-cache scales computed at start-up (vLLM's calculate_kv_scales): each layer's
k_scale = max |K| / 200 and v_scale = max |V| / 100, vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT.

A pool element e stands for e * k_scale (K) or e * v_scale (V) (kernels_pallas/reference.py), so
e4m3's 448 then covers 2.24x the largest K seen and 4.48x the largest V: room for inputs that
reach further than the calibration did before a write saturates. Scale 1.0, the default, suits a
model whose K and V stay well inside 448 and above e4m3's subnormals (below 2^-6 its precision
falls); a model whose K reach hundreds (large K biases, outlier channels) is clipped at 1.0, and
one whose V stay small loses part of them to the subnormals (SmolLM2: docs/caching.md).

vLLM takes the amax from the first batch the engine runs. cbjax's steps are compiled once at
start-up with each layer's scales inside (static, `Attention.kv_scales`, as its sliding window is:
each layer is traced on its own already), so it takes them before compiling, from
CALIBRATION_TEXTS run through the model as one prompt step into a float pool: the same post-RoPE K
and the same V that a request's prompt would write.

A checkpoint may carry its own scales (llm-compressor's, ModelOpt's: checkpoint/kv_scale_tensors.py); with an
fp8 pool they are used as they are, as vLLM uses them, unless calculate_kv_scales asks for calculated ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from cbjax.checkpoint.kv_scale_tensors import read_kv_scales
from cbjax.models.layers.attention import AttentionPlan
from cbjax.models.layers.kv_pool import KVPool, init_kv_pool
from cbjax.tokenizer.tokenizer import Tokenizer
from cbjax.worker.model_runner import FP8_KV_CACHE_DTYPES
from kernels_pallas.reference import AttentionMetadata

logger = logging.getLogger(__name__)

K_SCALE_CONSTANT = 200.0  # vLLM's envs.K_SCALE_CONSTANT: k_scale = max |K| / this
V_SCALE_CONSTANT = 100.0  # vLLM's envs.V_SCALE_CONSTANT: v_scale = max |V| / this

# What the calibration step reads: prose, a question, code, numbers and a list, each its own prompt (each starts
# as a request's prompt would, with the tokenizer's BOS where it adds one), and the question as a chat turn too
# where the tokenizer has a chat template.
CALIBRATION_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made books cheap "
    "enough for merchants and students to own. Within fifty years presses worked in more than two hundred cities, "
    "and the number of books in Europe grew from thousands to millions.",
    "What is the difference between a virus and a bacterium, and why do antibiotics only work against one of them?",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Order #48213, shipped 2024-03-17: 3 x USB-C cable (1.5 m) at $8.99, 1 x charger 65 W at $34.50; "
    "subtotal $61.47, tax 8.25%, total $66.54.",
    "Steps to repot a plant:\n1. Water it a day before.\n2. Choose a pot 2-5 cm wider.\n3. Loosen the roots gently.\n"
    "4. Fill with fresh soil and press lightly.\n5. Water again and keep it out of direct sun for a week.",
)


def calibration_prompts(tokenizer: Tokenizer, max_len: int | None = None) -> list[list[int]]:
    """The token ids of each calibration prompt, as the engine would get them from `generate` and `chat`, each cut
    to its first `max_len` (the engine's max_model_len: no position the model will not serve)."""
    prompts = [tokenizer.encode(text) for text in CALIBRATION_TEXTS]
    if tokenizer.chat_template is not None:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": CALIBRATION_TEXTS[1]}])
        prompts.append(tokenizer.encode_chat(chat))
    return [prompt[:max_len] for prompt in prompts]


def prompt_step(
    prompts: Sequence[Sequence[int]], block_size: int
) -> tuple[Int[Array, "tokens"], Int[Array, "tokens"], AttentionMetadata, int]:
    """One prompt step computing every prompt whole, each in its own blocks from block 1 on (0 is the null
    block): token ids, positions, metadata and the number of blocks the pool needs."""
    token_ids, positions, slots, starts, tables = [], [], [], [0], []
    next_block = 1
    for prompt in prompts:
        blocks = list(range(next_block, next_block + -(-len(prompt) // block_size)))
        next_block += len(blocks)
        token_ids += prompt
        positions += range(len(prompt))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(len(prompt))]
        starts.append(len(token_ids))
        tables.append(blocks)
    width = max(len(blocks) for blocks in tables)
    metadata = AttentionMetadata(
        slot_mapping=jnp.array(slots, jnp.int32),
        query_start_loc=jnp.array(starts, jnp.int32),
        seq_lens=jnp.array([len(p) for p in prompts], jnp.int32),
        block_tables=jnp.array([blocks + [0] * (width - len(blocks)) for blocks in tables], jnp.int32),
    )
    return jnp.array(token_ids, jnp.int32), jnp.array(positions, jnp.int32), metadata, next_block


def kv_amax(model: nnx.Module, prompts: Sequence[Sequence[int]], block_size: int,
            plan: AttentionPlan) -> Float[np.ndarray, "layers 2"]:
    """Each layer's largest |K| and |V| over the prompts, run as one prompt step into a pool of the model's
    activation dtype (the null block left out: no token of the step writes there)."""
    token_ids, positions, metadata, num_blocks = prompt_step(prompts, block_size)
    config = model.config
    pool = init_kv_pool(config, num_blocks, block_size, model.activation_dtype)
    graphdef, state = nnx.split(model)

    def amax(state: nnx.State, pool: KVPool) -> Float[Array, "layers 2"]:
        _, (k_pages, v_pages) = nnx.merge(graphdef, state).hidden_states(token_ids, positions, pool, metadata, plan)

        def per_layer(pages: Array) -> Array:
            pages = pages.reshape(pages.shape[0], config.num_hidden_layers, num_blocks, *pages.shape[2:])[:, :, 1:]
            return jnp.max(jnp.abs(pages.astype(jnp.float32)), axis=(0, 2, 3, 4))

        return jnp.stack([per_layer(k_pages), per_layer(v_pages)], axis=1)

    return np.asarray(jax.jit(amax)(state, pool))


def scales_from_amax(amax: Float[np.ndarray, "layers 2"]) -> list[tuple[float, float]]:
    """vLLM's (k_scale, v_scale) of each layer from its largest |K| and |V|; 1.0 where they are all zero."""
    if not np.isfinite(amax).all():
        bad = sorted({int(layer) for layer in np.nonzero(~np.isfinite(amax))[0]})
        raise ValueError(f"calculate_kv_scales: the calibration step's K or V is not finite in layers {bad}; the "
                         "model's weights give NaN or inf on plain text. Check the checkpoint, or serve without "
                         "calculate_kv_scales")
    return [(float(k) / K_SCALE_CONSTANT if k > 0 else 1.0, float(v) / V_SCALE_CONSTANT if v > 0 else 1.0)
            for k, v in amax]


def set_kv_scales(model: nnx.Module, scales: Sequence[tuple[float, float]]) -> None:
    """Give each decoder layer's attention its (k_scale, v_scale)."""
    layers = model.model.layers
    if len(scales) != len(layers):
        raise ValueError(f"{len(scales)} (k_scale, v_scale) pairs for a model of {len(layers)} layers")
    for layer, (k_scale, v_scale) in zip(layers, scales):
        layer.self_attn.kv_scales = (float(k_scale), float(v_scale))


def use_checkpoint_kv_scales(model: nnx.Module, checkpoint_dir: str | Path, kv_cache_dtype: str,
                             calculate: bool) -> list[tuple[float, float]] | None:
    """The fp8 KV-cache scales `checkpoint_dir` carries, set on `model` and returned where its pool is fp8 and
    `calculate` (calculate_kv_scales) is off; else None, with a log line saying why where it carries them."""
    scales = read_kv_scales(checkpoint_dir, len(model.model.layers))
    if scales is None:
        return None
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        logger.info("%s carries fp8 KV-cache scales, unused with kv_cache_dtype=%r: pass kv_cache_dtype='fp8' to "
                    "use them", checkpoint_dir, kv_cache_dtype)
        return None
    if calculate:
        logger.info("calculate_kv_scales: calculated scales replace the fp8 KV-cache scales %s carries",
                    checkpoint_dir)
        return None
    set_kv_scales(model, scales)
    k_scales, v_scales = np.array(scales).T
    logger.info("fp8 KV-cache scales from %s: k_scale %.3g-%.3g, v_scale %.3g-%.3g over %d layers", checkpoint_dir,
                k_scales.min(), k_scales.max(), v_scales.min(), v_scales.max(), len(scales))
    return scales


def calibrate_kv_scales(model: nnx.Module, tokenizer: Tokenizer, block_size: int, plan: AttentionPlan,
                        max_len: int | None = None) -> list[tuple[float, float]]:
    """Compute each layer's scales from the calibration prompts (cut to `max_len`), set them on `model` and return
    them."""
    start = time.perf_counter()
    prompts = calibration_prompts(tokenizer, max_len)
    amax = kv_amax(model, prompts, block_size, plan)
    scales = scales_from_amax(amax)
    set_kv_scales(model, scales)
    k_scales, v_scales = np.array(scales).T
    logger.info("calculate_kv_scales: k_scale %.3g-%.3g, v_scale %.3g-%.3g over %d layers (max |K| %.3g, |V| %.3g; "
                "%d calibration tokens, %.1f s)", k_scales.min(), k_scales.max(), v_scales.min(), v_scales.max(),
                len(scales), amax[:, 0].max(), amax[:, 1].max(), sum(map(len, prompts)), time.perf_counter() - start)
    return scales
