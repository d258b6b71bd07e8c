"""A GGUF file's tensors as the model's parameters, kept as stored where the engine has a kernel for them.

Decoder projections, the token embedding and the LM head in Q4_0, Q4_1 or Q4_K stay 4-bit: `...kernel`
nibbles [in / 2, out] with `...scales` and `...mins` [in / 32, out] beside it (gguf_q4.py), in IQ4_NL or IQ4_XS
too, with a `...grid` [16] of the values their nibbles index; in Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, Q3_K or Q2_K they
are held as int8: `...kernel` int8 [in, out] with `...scales` [in / G, out], G 32 or 16, and `...mins` beside
them for Q5_1, Q5_K and Q2_K (gguf_q8.py). A fused kernel whose parts differ in form is held in the int8 form
that holds each part exactly (gguf_forms.py). All are the file's own integers, which the packed C++ matmul or
its jnp form multiply. The embedding is kept as its LM head's kernel, [hidden, vocab]
(`model.embed_tokens.embedding`, with scales beside it): one copy is the tied head's weight, and the embedding
gather dequantizes only the rows it takes (models/layers/embedding.py). Every other tensor (F16, the norms, a
fused kernel with a part in another type) is dequantized to the model's dtype at load, and one log line says
which. The names, Q/K row order and checks are the importer's (gguf_import.py), so both read a file the same way.
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from cbjax.checkpoint.gguf_import import gguf_names, hf_tensor_name, rope_heads, unpermute_rope_rows
from cbjax.checkpoint.gguf_forms import STORED_FORMS, Form, common_form, stored_arrays, stored_shapes
from cbjax.checkpoint.params import check_params, expected_params, hf_to_params
from cbjax.models.config import ModelConfig
from cbjax.models.layers.linear import FUSED_PROJECTIONS, is_head_or_embedding, is_quantized_projection
from cbjax.models.registry import GGUFNames, architecture

logger = logging.getLogger(__name__)


def read_gguf_params(gguf_path: str | Path, config: ModelConfig, dtype: str,
                     tensor_parallel: bool = False) -> dict[str, np.ndarray]:
    """Every parameter of the model from the GGUF file, our names: quantized projections, embedding and head
    as stored, the rest dequantized to `dtype`; checked against the model (a kept tensor by the float shape
    it stands for). Under `tensor_parallel` the embedding and head are dequantized: the vocabulary split
    takes a float table (as quantize_lm_head, a quantized head is for one device)."""
    reader = GGUFReader(gguf_path)
    names, slots, stored = _tensor_forms(reader, gguf_path, config, tensor_parallel)
    params: dict[str, np.ndarray] = {}
    logical: dict[str, tuple[tuple[int, ...], np.dtype]] = {}  # the float tensor each kept one stands for
    kept, dequantized = collections.Counter(), collections.defaultdict(list)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions fastest first: HF's [out, in]
        heads = rope_heads(tensor.name, config.num_attention_heads, config.num_key_value_heads)
        if tensor.name in stored:
            name, (out, k) = slots[tensor.name], shape
            order = None if heads is None else unpermute_rope_rows(np.arange(out), heads)
            arrays = stored_arrays(tensor.data, tensor.tensor_type, k, stored[tensor.name], order)
            params.update({_param_name(name, leaf): array for leaf, array in arrays.items()})
            logical[name] = (shape if name.endswith(".embedding") else (k, out), jnp.dtype(dtype))
            kept[tensor.tensor_type.name] += 1
            continue
        weight = _dequantized(tensor, gguf_path).reshape(shape)
        weight = weight if heads is None else unpermute_rope_rows(weight, heads)
        for name, array, _ in hf_to_params(hf_tensor_name(tensor.name, names), weight.astype(dtype), config):
            params[name] = array
        dequantized[tensor.tensor_type.name].append(tensor.name)
    found = {name: (array.shape, array.dtype) for name, array in params.items()
             if not name.endswith((".scales", ".mins", ".grid"))}
    check_params(expected_params(config, jnp.dtype(dtype)), {**found, **logical}, source=str(gguf_path))
    logger.info("GGUF %s as stored: %d tensors kept quantized (%s); dequantized to %s at load: %s", Path(gguf_path).resolve().name,
                sum(kept.values()), ", ".join(f"{n} {kind}" for kind, n in kept.items()) or "none", dtype,
                "; ".join(f"{len(tensors)} {kind} ({', '.join(tensors[:3])}{', ...' if len(tensors) > 3 else ''})"
                          for kind, tensors in dequantized.items()))
    return params


def gguf_stored_shapes(gguf_path: str | Path, config: ModelConfig, dtype: str | jnp.dtype,
                       tensor_parallel: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    """The parameters read_gguf_params makes of the file, as shapes and dtypes, from its tensor list alone (no
    tensor data is read): what `cbjax plan` counts for a GGUF file served as stored."""
    reader = GGUFReader(gguf_path)
    _, slots, stored = _tensor_forms(reader, gguf_path, config, tensor_parallel)
    shapes = expected_params(config, jnp.dtype(dtype))  # every tensor dequantized to dtype; then the kept ones
    for tensor in reader.tensors:
        if tensor.name in stored:
            name = slots[tensor.name]
            out, k = (int(d) for d in reversed(tensor.shape))
            del shapes[name]  # the float tensor it stands for, replaced by the leaves it is kept as
            shapes.update({_param_name(name, leaf): jax.ShapeDtypeStruct(*spec)
                           for leaf, spec in stored_shapes(stored[tensor.name], k, out).items()})
    return shapes


def _param_name(kernel_name: str, leaf: str) -> str:
    """The parameter a stored tensor's leaf (gguf_forms: "kernel", "scales", ...) becomes: the kernel's (or
    embedding's) own name, the others beside it."""
    return kernel_name if leaf == "kernel" else kernel_name[: kernel_name.rindex(".") + 1] + leaf


def check_as_stored(model_dir: Path, quantization: str | None) -> None:
    """Refuse what a GGUF file served as stored cannot do, naming the way that can."""
    if quantization is not None:
        raise ValueError(
            f"{model_dir} serves a GGUF file whose weights are already quantized; quantization={quantization!r} "
            f"cannot quantize them again: drop quantization=, or quantize a float checkpoint (cbjax import-gguf + convert)"
        )


def _dequantized(tensor, gguf_path: str | Path) -> np.ndarray:
    try:
        return dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise ValueError(
            f"{gguf_path}: tensor {tensor.name} is {tensor.tensor_type.name}, which neither the quantized kernels "
            f"({', '.join(t.name for t in STORED_FORMS)}) nor the gguf package's dequantizer reads; "
            f"requantize the model to one of those or a common type (Q8_0, Q6_K, F16)"
        ) from error


def _tensor_forms(reader: GGUFReader, gguf_path: str | Path, config: ModelConfig,
                  tensor_parallel: bool) -> tuple[GGUFNames, dict[str, str | None], dict[str, Form]]:
    """The file's tensor names (gguf_names), our parameter name for each of its tensors, and the form of each
    kept as stored, by GGUF name (under `tensor_parallel` not the embedding and head: the vocabulary split
    takes floats)."""
    architecture_field = reader.fields.get("general.architecture")  # the only key needed: the rest is the tokenizer's
    names = gguf_names({"general.architecture": architecture_field and architecture_field.contents()}, gguf_path)
    slots = {tensor.name: _our_name(hf_tensor_name(tensor.name, names), config) for tensor in reader.tensors}
    stored = _kept_as_stored({tensor.name: tensor.tensor_type for tensor in reader.tensors}, slots)
    if tensor_parallel:
        stored = {gguf: form for gguf, form in stored.items() if not is_head_or_embedding(slots[gguf])}
    return names, slots, stored


def _our_name(hf_name: str, config: ModelConfig) -> str | None:
    slot = architecture(config.architecture).param_slot(hf_name, 2, config.tie_word_embeddings)
    return None if slot is None else slot[0]


def _kept_as_stored(types: dict, slots: dict[str, str | None]) -> dict[str, Form]:
    """The GGUF names of the tensors kept as stored, each with the form it is held in: decoder projections, the
    embedding and the LM head in a type of STORED_FORMS, a projection only where its fused partners (q/k/v,
    gate/up: one kernel on one device) are stored too, in their kernel's common_form."""
    candidates = {gguf: ours for gguf, ours in slots.items() if ours is not None and types[gguf] in STORED_FORMS
                  and (is_quantized_projection(ours, (0, 0)) or is_head_or_embedding(ours))}
    own = {ours: STORED_FORMS[types[gguf]] for gguf, ours in candidates.items()}
    form = dict(own)
    for ours in own:
        layer = ".".join(ours.split(".")[:3])  # model.layers.N
        for parts in FUSED_PROJECTIONS.values():
            group = [f"{layer}.{part}.kernel" for part in parts]
            if ours in group:
                form[ours] = common_form([own[part] for part in group]) if set(group) <= set(own) else None
    return {gguf: form[ours] for gguf, ours in candidates.items() if form[ours] is not None}
