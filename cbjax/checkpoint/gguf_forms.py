"""The form each GGUF tensor kept as stored takes in the model, and the arrays of that form.

A form is (bits, group, mins, grid): 4-bit nibbles with scales and mins per group of 32 (gguf_q4.py: Q4_0, Q4_1,
Q4_K; IQ4_NL and IQ4_XS with their nibbles indexing IQ4's 16-value grid), or int8 with scales per group of 32 or
16, and mins where the type has them (gguf_q8.py: Q8_0, Q5_0, Q6_K, Q3_K; Q5_1, Q5_K, Q2_K with mins). A fused
kernel (q/k/v, gate/up) has one form, and llama.cpp's K-quant mixes give its parts different types: its Q4_K_M
keeps v_proj in Q6_K on some layers beside Q4_K q and k, its Q5_K_M keeps v in Q8_0 beside Q5_1 q and k where 256
does not divide a row. Such parts share the int8 form that holds each of them exactly (`common_form`): a 4-bit
part's q (or IQ4's grid value) widened to int8, scales (and mins) repeated where the group is smaller, zero mins
where a part has none. Each weight stays the file's own q * scale + min.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType
from jaxtyping import UInt8

from cbjax.checkpoint.gguf_q4 import GROUP as Q4_GROUP
from cbjax.checkpoint.gguf_q4 import STORED_TYPES as Q4_TYPES
from cbjax.checkpoint.gguf_q4 import gguf_q4_groups
from cbjax.checkpoint.gguf_q8 import INT8_GROUPS, IQ4_VALUES, WITH_MINS, gguf_int8_groups, gguf_iq4_indices
from kernels_cpu.quant4 import pack_nibbles


class Form(NamedTuple):
    bits: int  # 4: nibbles [in / 2, out]; 8: int8 [in, out]
    group: int  # inputs per scale
    mins: bool  # whether `...mins` [in / group, out] sits beside `...scales`
    grid: bool = False  # 4-bit: whether the nibbles index `...grid` [16] (IQ4's values) rather than stand for 0..15


IQ4_TYPES = (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS)
# Each type kept as stored -> its own form. IQ4's nibbles index its grid (mins 0); in a fused kernel beside other
# types they are held as int8 like the rest (INT8_GROUPS: the grid's values, which are int8).
STORED_FORMS = {**{qtype: Form(8, group, qtype in WITH_MINS) for qtype, group in INT8_GROUPS.items()},
                **{qtype: Form(4, Q4_GROUP, True) for qtype in Q4_TYPES},
                **{qtype: Form(4, 32, True, grid=True) for qtype in IQ4_TYPES}}


def common_form(forms: list[Form]) -> Form:
    """The one form of a fused kernel whose parts are stored in `forms`: theirs where they agree, else int8 in
    the largest group dividing every part's, with mins if any part has them."""
    if len(set(forms)) == 1:
        return forms[0]
    return Form(8, math.gcd(*(form.group for form in forms)), any(form.mins for form in forms))


def leaves(form: Form) -> tuple[str, ...]:
    """The parameters beside a kernel of `form`: scales and mins [in / group, out], a grid [16]."""
    return tuple(leaf for leaf, held in (("scales", True), ("mins", form.mins), ("grid", form.grid)) if held)


def stored_shapes(form: Form, k: int, out: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The (shape, dtype) of each array stored_arrays makes of a tensor [out, k] in `form`, by leaf."""
    kernel = ((k // 2, out), np.dtype(np.uint8)) if form.bits == 4 else ((k, out), np.dtype(np.int8))
    return {"kernel": kernel, **{leaf: ((16,) if leaf == "grid" else (k // form.group, out), np.dtype(np.float32))
                                 for leaf in leaves(form)}}


def stored_arrays(
    data: UInt8[np.ndarray, "out nbytes"], qtype: GGMLQuantizationType, k: int, form: Form,
    column_order: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """A stored GGUF tensor [out, k] in `form` (its own, or its fused kernel's common_form) as an [in, out]
    kernel's arrays by leaf: "kernel" (nibbles [k / 2, out] or int8 [k, out]), "scales" and, if the form has
    them, "mins" [k / group, out]; `column_order` reorders the output columns (llama.cpp's Q/K rope rows)."""
    if qtype in Q4_TYPES:
        q, scales, mins = gguf_q4_groups(data, qtype, k)
    elif qtype in IQ4_TYPES and form.bits == 4:
        (q, scales), mins = gguf_iq4_indices(data, qtype, k), None
    else:
        q, scales, mins = gguf_int8_groups(data, qtype, k)
    own = STORED_FORMS[qtype]
    if form.bits == 4 and own != form or form.bits == 8 and own.group % form.group:
        raise ValueError(f"GGUF type {qtype.name} ({own}) cannot be held in {form}")
    repeat = own.group // form.group  # a part's groups cut into the common form's smaller ones
    order = slice(None) if column_order is None else column_order
    arrays = {"kernel": pack_nibbles(q[order].T) if form.bits == 4 else np.ascontiguousarray(q[order].T.astype(np.int8)),
              "scales": scales}
    if form.mins:
        arrays["mins"] = np.zeros_like(scales) if mins is None else mins
    for leaf in ("scales", "mins")[: 1 + form.mins]:
        arrays[leaf] = np.ascontiguousarray(np.repeat(arrays[leaf][order].T, repeat, axis=0))
    if form.grid:
        arrays["grid"] = IQ4_VALUES.astype(np.float32)
    return arrays
