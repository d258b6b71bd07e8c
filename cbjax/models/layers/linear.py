"""The decoder's projections: nnx.Linear that may run packed for the CPU matmul kernel, and the
checkpoint rearrangements done at load (fused q/k/v and gate/up, packed kernels), by parameter name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from cbjax.models.layers.attention import AttentionPlan
from cbjax.quantization import check_quantization, int4_group_size, int4_groups_dividing
from kernels_cpu import group_rows_packable, pack_group_rows, pack_weight, packable, packed_matmul_cpu
from kernels_cpu import packed_matmul_reference, scales_width
from kernels_cpu.quant import SCALED_DTYPES, int8_matmul, quantize_int8
from kernels_cpu.quant4 import int4_matmul, quantize_int4

# A quantized kernel's dtype -> its unpacked product: int8 q [in, out] with scales [out] or [in / G, out] (GGUF's
# Q8_0, Q6_K, Q5_0, ...), and mins [in / G, out] too (GGUF's Q5_1, Q5_K, Q2_K); 4-bit nibbles [in / 2, out] with
# scales and mins [in / G, out] (GGUF's 4-bit tensors too) and maybe a grid [16] of the values its nibbles index
# (GGUF's IQ4_NL, IQ4_XS).
# fp8 (e4m3fn) q [in, out] with scales [out] or [in / G, out]: a checkpoint's fp8 weights as stored
# (checkpoint/fp8_checkpoint.py), multiplied as int8 ones are.
QUANTIZED_KERNELS = {**dict.fromkeys(SCALED_DTYPES, int8_matmul), jnp.dtype(jnp.uint8): int4_matmul}
BESIDE = ("scales", "mins", "grid")  # the parameters a quantized kernel may have beside it, in the products' order


def beside_values(module: nnx.Module) -> list[Array]:
    """The values of the parameters beside `module`'s quantized kernel or table (BESIDE, those it has; none for
    a float one)."""
    return [getattr(module, leaf)[...] for leaf in BESIDE if isinstance(getattr(module, leaf, None), nnx.Variable)]


class Linear(nnx.Linear):
    """nnx.Linear whose kernel may be packed for the CPU matmul kernel ([out / 32, in, 32], see
    `pack_linears`, or int8 panels by `quantize_linears`): then the product is the C++ kernel's where
    the plan runs the C++ kernels, else its jnp reference. An int8 kernel (with `scales` [out] set by
    `quantize_linears`, or [in / G, out] and maybe `mins` from a GGUF file) is multiplied as (x @ q) * scales
    (group by group), a 4-bit one (uint8 nibbles with `scales` and `mins`, maybe a `grid`) group by group
    (kernels_cpu/quant4.py). An unpacked float kernel ([in, out]) is nnx.Linear's dot. With LoRA slots (layers/lora.py's attach_lora), each token's adapter update is added
    to the product."""

    lora = None  # layers/lora.LoRASlots where attach_lora gave it slots

    def __call__(self, x: Float[Array, "... in"], plan: AttentionPlan = AttentionPlan()) -> Float[Array, "... out"]:
        y = self.base_product(x, plan)
        return y if self.lora is None else y + self.lora(x).astype(y.dtype)

    def base_product(self, x: Float[Array, "... in"], plan: AttentionPlan) -> Float[Array, "... out"]:
        kernel = self.kernel[...]
        if kernel.ndim == 2 and kernel.dtype not in QUANTIZED_KERNELS:
            return super().__call__(x)
        quantized = beside_values(self)
        # A quantized product returns in the dtype a float kernel's dot would give (bf16 activations stay bf16).
        y = kernel_product(x, kernel, quantized, plan).astype(self.preferred_element_type or x.dtype)
        return y if self.bias is None else y + self.bias[...]


def kernel_product(
    x: Float[Array, "... in"], kernel: Array, quantized: list[Array], plan: AttentionPlan,
) -> Float[Array, "... out"]:
    """x @ a quantized [in, out] kernel (its `quantized` leaves: QUANTIZED_KERNELS) or a packed one (with
    them, if any): the C++ kernel's product where the plan runs the C++ kernels, else the jnp one; float32."""
    if kernel.ndim == 2:
        return QUANTIZED_KERNELS[kernel.dtype](x, kernel, *quantized)
    return (packed_matmul_cpu if plan.backend == "cpp" else packed_matmul_reference)(x, kernel, *quantized)


# The weight dtypes the packed C++ matmul takes. The engine packs bfloat16 ones only where the kernel multiplies
# them on AMX tiles (worker/build.py: its vdpbf16ps path ran slower than XLA:CPU's dots in whole engines,
# `python -m benchmarks.bf16_paths`).
PACKED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def pack_linears(params: dict[str, np.ndarray], dtype: str | np.dtype, floats: bool = True) -> dict[str, np.ndarray]:
    """`params` with every decoder layer's projection cast to `dtype` and packed for the CPU
    matmul kernel (kernels_cpu.pack_weight) where `dtype` is one of PACKED_DTYPES, the width
    allows and `floats` says so; quantized kernels kept as stored (a GGUF file's int8 or 4-bit projections,
    embedding and LM head) into int8 or nibble panels; a float LM head and embedding as they are. The cast
    comes first, so the layout is the served dtype's. One tensor at a time: each packed copy replaces its original."""
    if jnp.dtype(dtype) not in PACKED_DTYPES:
        return params
    for name in [n for n in params if is_quantized_projection(n, (0, 0)) or is_head_or_embedding(n)]:
        if params[name].dtype in QUANTIZED_KERNELS:
            params[name] = pack_weight(params.pop(name))  # as stored: int8 or nibble panels
            pack_scales_beside(params, name)
        elif floats and is_quantized_projection(name, (0, 0)) and packable(params[name].shape, dtype):
            params[name] = pack_weight(params.pop(name).astype(jnp.dtype(dtype), copy=False))
    return params


def pack_scales_beside(params: dict[str, np.ndarray], kernel_name: str) -> None:
    """Pack the scales and mins beside a packed 4-bit kernel by panel (kernels_cpu.pack_group_rows), where its
    width is whole panels: the C++ kernel then reads each panel's as one stream. int8 scales stay as they are."""
    prefix = kernel_name[: kernel_name.rindex(".") + 1]
    if params[kernel_name].dtype == jnp.uint8 and group_rows_packable(params[prefix + "scales"]):
        for leaf in ("scales", "mins"):
            params[prefix + leaf] = pack_group_rows(params.pop(prefix + leaf))


def float_equivalent_bytes(params: dict[str, Array], dtype: jnp.dtype) -> int:
    """The bytes of `params` with every quantized kernel (int8 or 4-bit, packed or not, a quantized embedding
    too) counted as the [in, out] float kernel of `dtype` it stands for, and its scales and mins not at all:
    the size of the model, whatever its weights' compression (the CPU pool follows it: core/kv/sizing.py)."""
    total = 0
    for name, array in params.items():
        prefix, _, leaf = name.rpartition(".")
        quantized = array.dtype in QUANTIZED_KERNELS and f"{prefix}.scales" in params
        if leaf in BESIDE and (f"{prefix}.kernel" in params or f"{prefix}.embedding" in params):
            continue
        if not quantized:
            total += array.nbytes
            continue
        k = array.shape[-2] if array.ndim == 3 else array.shape[0]  # panels [P, K(/2), 32] or [K(/2), N]
        n = scales_width(params[f"{prefix}.scales"])
        total += k * (2 if array.dtype == jnp.uint8 else 1) * n * jnp.dtype(dtype).itemsize
    return total


def is_quantized_projection(kernel_name: str, shape: tuple[int, ...]) -> bool:
    """Whether `quantization=` quantizes this kernel: a decoder layer's [in, out] projection (fused or
    not). Embeddings, the LM head and a MoE layer's stacked experts [E, in, out] stay float."""
    return ".layers." in kernel_name and kernel_name.endswith("_proj.kernel") and len(shape) == 2


def is_head_or_embedding(name: str) -> bool:
    """Whether `name` is the LM head's kernel or the token embedding (which a tied model's head reuses)."""
    return name in ("lm_head.kernel", "model.embed_tokens.embedding")


def quantize_linears(
    params: dict[str, np.ndarray], quantization: str | None, pack: bool = False, lm_head: bool = False,
) -> dict[str, np.ndarray]:
    """`params` with every decoder layer's projection kernel [in, out] quantized (kernels_cpu.quant,
    quant4): "int8" `...kernel` int8 and `...scales` [out] float32 beside it; "int4" `...kernel` uint8
    nibbles [in / 2, out] and `...scales`, `...mins` [in / G, out] (G 128, or the name's "-gG"). With `pack`, the kernel is packed in
    32-column panels for the CPU matmul kernel (kernels_cpu.pack_weight), 4-bit scales and mins by panel
    too (pack_scales_beside). Embeddings and the LM head
    stay in the activation dtype (their rows are gathered, and the head's error lands on every logit) unless
    `lm_head`: then the LM head kernel [hidden, vocab] is quantized too, or, in a tied model, the embedding
    [vocab, hidden] as that kernel (its transpose; layers/embedding.py gathers its rows): int8 per vocabulary
    row, 4-bit in groups along the hidden size.
    Run on the float weights at load, after fuse_projections (a fused kernel's columns keep their own
    scales) and instead of pack_linears. One tensor at a time: each quantized copy replaces its original."""
    check_quantization(quantization)
    if quantization is None:
        return params
    head = ("lm_head.kernel" if "lm_head.kernel" in params else "model.embed_tokens.embedding") if lm_head else None
    if head == "model.embed_tokens.embedding":
        params[head] = np.ascontiguousarray(np.asarray(params.pop(head)).T)  # the tied head's kernel [hidden, vocab]
    for name in list(params):
        if is_quantized_projection(name, params[name].shape) or name == head:
            if quantization != "int8":
                check_int4_group(quantization, name, params[name].shape[0])
            weight = params.pop(name)
            q, *beside = quantize_int8(weight) if quantization == "int8" else quantize_int4(weight, int4_group_size(quantization))
            params.update(zip((name[: name.rindex(".") + 1] + leaf for leaf in ("scales", "mins")), beside))
            params[name] = pack_weight(q) if pack else q
            if pack:
                pack_scales_beside(params, name)
    return params


def check_int4_group(quantization: str, name: str, k: int) -> None:
    """Raise naming the group, the width and the names that fit unless the group divides `k` inputs."""
    if k % int4_group_size(quantization):
        raise ValueError(
            f"quantization={quantization!r} quantizes groups of {int4_group_size(quantization)} inputs, which do not "
            f"divide the {k} inputs of {name}; use one whose group divides {k}: {int4_groups_dividing(k) or 'none'}"
        )


def quantized_leaves(quantization: str, k: int, n: int) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    """The (shape, dtype) of each parameter quantize_linears makes of an unpacked [k, n] kernel, by leaf name."""
    if quantization == "int8":
        return {"kernel": ((k, n), jnp.int8), "scales": ((n,), jnp.float32)}
    check_int4_group(quantization, "a projection", k)
    groups = (k // int4_group_size(quantization), n)
    return {"kernel": ((k // 2, n), jnp.uint8), "scales": (groups, jnp.float32), "mins": (groups, jnp.float32)}


def declare_stored(model: nnx.Module, params: dict[str, np.ndarray]) -> nnx.Module:
    """`model` (abstract) with each projection, LM head or embedding that `params` holds quantized (a
    `...scales` beside its kernel, as a GGUF file's quantized tensors are read) declared as that kernel and
    the scales (and mins) beside it. A quantized embedding is held as its head's kernel [hidden, vocab]
    (layers/embedding.py), so a tied model's transposed head copy (`tied_head`) is dropped."""
    for path, module in list(nnx.iter_modules(model)):  # listed first: the loop replaces variables
        prefix = "".join(f"{key}." for key in path)
        weight = "embedding" if isinstance(module, nnx.Embed) else "kernel"
        if isinstance(module, (Linear, nnx.Embed)) and prefix + "scales" in params:
            for leaf in (weight, *(leaf for leaf in BESIDE if prefix + leaf in params)):
                setattr(module, leaf, nnx.Param(jax.ShapeDtypeStruct(params[prefix + leaf].shape, params[prefix + leaf].dtype)))
            if weight == "embedding" and getattr(model, "tied_head", None) is not None:
                model.tied_head = None
    return model


def declare_quantized(model: nnx.Module, quantization: str | None, lm_head: bool = False) -> nnx.Module:
    """`model` with each projection that quantize_linears quantizes declared as its quantized kernel and
    the float32 parameters beside it (quantized_leaves), so its state has the quantized weights' names,
    shapes and dtypes (build it under nnx.eval_shape to get shapes only). With `lm_head` (quantize_linears'
    own), the LM head too, or a tied model's embedding as its head's quantized kernel [hidden, vocab] (without
    the transposed float copy, as declare_stored)."""
    check_quantization(quantization)
    if quantization is None:
        return model
    for path, module in list(nnx.iter_modules(model)):  # listed first: the loop replaces variables
        name = ".".join(map(str, (*path, "kernel")))
        if isinstance(module, Linear) and (is_quantized_projection(name, module.kernel.shape) or (lm_head and name == "lm_head.kernel")):
            for leaf, (shape, dtype) in quantized_leaves(quantization, *module.kernel.shape).items():
                setattr(module, leaf, nnx.Param(jnp.zeros(shape, dtype)))
    if lm_head and getattr(model, "lm_head", False) is None:  # tied: the embedding is the head's kernel
        embed = model.model.embed_tokens
        vocab, hidden = embed.embedding.shape
        for leaf, (shape, dtype) in quantized_leaves(quantization, hidden, vocab).items():
            setattr(embed, "embedding" if leaf == "kernel" else leaf, nnx.Param(jnp.zeros(shape, dtype)))
        model.tied_head = None
    return model


# Fused kernels (a model's fused_projections) and the checkpoint kernels whose columns they
# hold, in order: e.g. `model.layers.3.self_attn.qkv_proj` from q_proj, k_proj and v_proj.
FUSED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(params: dict[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """`params` (checkpoint names, kernels [in, out]) with each layer's q/k/v and gate/up kernels
    (and biases; 4-bit nibbles with their scales and mins) concatenated along their output columns into the fused model's parameters. One
    layer at a time: each fused copy replaces its parts."""
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        for fused, parts in FUSED_PROJECTIONS.items():
            for leaf, axis in (("kernel", 1), ("bias", 0), ("scales", -1), ("mins", -1), ("grid", None)):
                names = [f"{prefix}{part}.{leaf}" for part in parts]  # scales and mins: [groups, out]
                if all(name in params for name in names) and axis is None:  # one grid the parts share (gguf_forms.py)
                    grids = [params.pop(name) for name in names]
                    if any(not np.array_equal(grid, grids[0]) for grid in grids):
                        raise ValueError(f"fuse_projections: {', '.join(names)} index different grids; a fused kernel has one")
                    params[f"{prefix}{fused}.{leaf}"] = grids[0]
                elif all(name in params for name in names):
                    params[f"{prefix}{fused}.{leaf}"] = np.concatenate([params.pop(name) for name in names], axis=axis)
                elif any(name in params for name in names):
                    raise ValueError(f"fuse_projections: {', '.join(n for n in names if n not in params)} missing beside "
                                     f"{', '.join(n for n in names if n in params)}")
    return params


def linear(
    in_features: int, out_features: int, use_bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs,
    activation_dtype: jnp.dtype | None = None,
) -> Linear:
    """Weights and dot inputs in `dtype`; the product accumulates into `activation_dtype` if given."""
    return Linear(
        in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=dtype,
        preferred_element_type=activation_dtype, rngs=rngs,
    )
