"""x @ w with w packed in 32-column panels: the C++ kernel (`packed_matmul.cc`) and its jnp reference.

A float32 [K, N] weight packed is [N / 32, K, 32]: panel p holds columns 32p..32p+31, row by
row, so the kernel streams each panel from memory in one run. A bfloat16 one is [N / 32,
ceil(K / 2), 64]: the same panels with rows k and k+1 interleaved per column (a zero row pads an
odd K), the pairs the bf16 dot instruction multiplies; x is then rounded to bfloat16 and the
products summed in float32, as XLA's bf16 x bf16 -> f32 dot of x.astype(bf16) does. Only widths
that are a multiple of 32 pack, except int8: an int8 [K, N] weight (kernels_cpu/quant.py, with its
float32 scales [N], or [K / G, N] for a scale per group of G inputs, with mins [K / G, N] beside them
for GGUF's types that have them) packs as [ceil(N / 32), K, 32], zero columns filling the last panel, and
the kernel widens it to float32 as it goes: a quarter of float32's bytes to stream. fp8 (e4m3fn) weights with
scales, a checkpoint's as stored, pack and multiply as int8 ones do (without mins). 4-bit nibbles u8 [K / 2, N]
(kernels_cpu/quant4.py, with float32 scales and mins [K / G, N]) pack the same way, as [ceil(N / 32), K / 2, 32]: byte (p, s, c) holds column
32p + c at k = 2s (low nibble) and 2s + 1 (high), an eighth of float32's bytes. Where N is a whole number of
panels the engine packs their scales and mins too (`pack_group_rows`), as [N / 32, K / G, 32]: each panel's
groups follow one another, a stream beside its nibbles rather than rows N floats apart, which the kernel reads
faster at a decode step's few rows (`python -m benchmarks.quant_kernels --kernels int4-g32 int4-g32-rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int8, UInt8

from kernels_cpu.quant import SCALED_DTYPES, check_int8_groups, int8_matmul
from kernels_cpu.quant4 import int4_matmul
from kernels_cpu.registry import target

PANEL = 32  # columns per panel
# The packed layout's name in the weights cache: a new one for any change to pack_weight or to what is packed.
LAYOUT = "packed-3"
FP8 = jnp.dtype(jnp.float8_e4m3fn)  # a checkpoint's fp8 weights as stored: read as int8 ones are, with scales
TARGETS = {jnp.dtype(jnp.float32): "CbjaxPackedMatmulF32", jnp.dtype(jnp.bfloat16): "CbjaxPackedMatmulBF16",
           jnp.dtype(jnp.int8): "CbjaxPackedMatmulI8", jnp.dtype(jnp.uint8): "CbjaxPackedMatmulQ4",
           FP8: "CbjaxPackedMatmulF8"}
INT8_MINS_TARGET = "CbjaxPackedMatmulI8Mins"  # int8 panels with scales and mins [K / G, N]
Q4_GRID_TARGET = "CbjaxPackedMatmulQ4Grid"  # nibble panels indexing a grid [16] of values
QUANTIZED = (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8), FP8)  # int8, 4-bit nibbles, fp8: panels of any width, zero-padded


def packable(shape: tuple[int, ...], dtype: np.dtype | jnp.dtype) -> bool:
    """Whether a [K, N] weight of this shape and dtype can be packed for the kernel (float32 or
    bfloat16 with N a multiple of 32; int8 or 4-bit nibbles of any N)."""
    return (len(shape) == 2 and shape[1] > 0 and jnp.dtype(dtype) in TARGETS
            and (shape[1] % PANEL == 0 or jnp.dtype(dtype) in QUANTIZED))


def pack_weight(
    w: Float[np.ndarray, "k n"] | Int8[np.ndarray, "k n"] | UInt8[np.ndarray, "k2 n"],
) -> Float[np.ndarray, "panels steps width"]:
    """[K, N] -> [N / 32, K, 32] (float32), [ceil(N / 32), K, 32] (int8, zero columns after N; 4-bit
    nibbles [K / 2, N] alike) or [N / 32, ceil(K / 2), 64] (bfloat16), contiguous (a host copy)."""
    if not packable(w.shape, w.dtype):
        raise ValueError(
            f"pack_weight takes an int8 [K, N] weight, uint8 4-bit nibbles, or a float32 or bfloat16 one with N a multiple of {PANEL}, "
            f"got {w.dtype} {w.shape}"
        )
    w = np.asarray(w)
    k, n = w.shape
    if w.dtype != jnp.bfloat16:
        w = np.pad(w, ((0, 0), (0, -n % PANEL)))  # int8/4-bit only: float widths are whole panels
        return np.ascontiguousarray(w.reshape(k, -1, PANEL).transpose(1, 0, 2))
    pairs = np.concatenate([w, np.zeros((k % 2, n), w.dtype)]).reshape(-1, 2, n // PANEL, PANEL)
    return np.ascontiguousarray(pairs.transpose(2, 0, 3, 1)).reshape(n // PANEL, -1, 2 * PANEL)


def group_rows_packable(rows: Float[np.ndarray, "g n"]) -> bool:
    """Whether 4-bit scales or mins [K / G, N] pack (`pack_group_rows`): N a whole number of panels."""
    return rows.ndim == 2 and rows.shape[1] > 0 and rows.shape[1] % PANEL == 0


def pack_group_rows(rows: Float[np.ndarray, "g n"]) -> Float[np.ndarray, "panels g width"]:
    """4-bit scales or mins [K / G, N] -> [N / 32, K / G, 32] (N a whole number of panels), contiguous: panel
    p's groups one after another, as the kernel reads them beside panel p's nibbles."""
    if not group_rows_packable(rows):
        raise ValueError(f"pack_group_rows takes 4-bit scales or mins [K / G, N] with N a multiple of {PANEL}, "
                         f"got {rows.shape}")
    groups, n = rows.shape
    return np.ascontiguousarray(np.asarray(rows).reshape(groups, n // PANEL, PANEL).transpose(1, 0, 2))


def scales_width(scales: Float[Array, "..."]) -> int:
    """The output columns N that scales stand for: [N], [K / G, N], or packed by panel [N / 32, K / G, 32]."""
    return scales.shape[0] * scales.shape[2] if scales.ndim == 3 else scales.shape[-1]


def unpack_group_rows(packed: Float[Array, "panels g width"]) -> Float[Array, "g n"]:
    """pack_group_rows' inverse (numpy or jnp)."""
    panels, groups, width = packed.shape
    return packed.transpose(1, 0, 2).reshape(groups, panels * width)


def unpack_weight(packed: Float[Array, "panels steps width"], k: int | None = None, n: int | None = None) -> Float[Array, "k n"]:
    """pack_weight's inverse; `k` trims the zero row that pads a bfloat16 weight of odd K, `n` the
    zero columns that pad an int8 weight's last panel."""
    panels, steps, width = packed.shape
    per_step = width // PANEL
    w = packed.reshape(panels, steps, PANEL, per_step).transpose(1, 3, 0, 2).reshape(steps * per_step, panels * PANEL)
    return w[: k if k is not None else steps * per_step, : n if n is not None else panels * PANEL]


def packed_matmul_reference(
    x: Float[Array, "*rows k"], packed: Float[Array, "panels steps width"], scales: Float[Array, "*g n"] | None = None,
    mins: Float[Array, "g n"] | None = None, grid: Float[Array, "16"] | None = None,
) -> Float[Array, "*rows n"]:
    """x @ w from the packed w (int8: with its scales, x @ (q * scales), and mins [K / G, N] if given, x @ (q *
    scales + mins); 4-bit: scales and mins [K / G, N] or packed [N / 32, K / G, 32], x @ (q * scales + mins) by
    groups, the nibbles indexing `grid` if given), in jnp (any platform): what the kernel computes."""
    if packed.dtype == jnp.uint8:
        if scales.ndim == 3:
            scales, mins = unpack_group_rows(scales), unpack_group_rows(mins)
        return int4_matmul(x, unpack_weight(packed, n=scales.shape[-1]), scales, mins, grid)
    if packed.dtype in SCALED_DTYPES:
        return int8_matmul(x.astype(jnp.float32), unpack_weight(packed, n=scales.shape[-1]), scales, mins)
    w = unpack_weight(packed, x.shape[-1])
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def packed_matmul_cpu(
    x: Float[Array, "*rows k"], packed: Float[Array, "panels steps width"], scales: Float[Array, "*g n"] | None = None,
    mins: Float[Array, "g n"] | None = None, grid: Float[Array, "16"] | None = None,
) -> Float[Array, "*rows n"]:
    """x @ w from the packed w, by the C++ kernel (CPU only); float32 x and result. An int8 w takes
    its float32 scales [N] (w = q * scales per column) or [K / G, N] (per group of G inputs), which also
    give N, and may take mins [K / G, N] beside grouped scales (w = q * scales + mins per group); 4-bit
    nibble panels take scales and mins [K / G, N] (w = q * scales + mins per group) or packed by
    pack_group_rows ([N / 32, K / G, 32], N whole panels), and may take a grid [16] their nibbles index."""
    dtype = jnp.dtype(packed.dtype)
    # scales' ranks (None: no scales); 4-bit 3: packed by panel
    expected_scales = {jnp.dtype(jnp.int8): (1, 2), jnp.dtype(jnp.uint8): (2, 3), FP8: (1, 2)}.get(dtype)
    per_step = 2 if dtype in (jnp.bfloat16, jnp.uint8) else 1  # k per step of a panel
    if (
        packed.ndim != 3 or dtype not in TARGETS or packed.shape[2] != PANEL * (2 if dtype == jnp.bfloat16 else 1)
        or -(-x.shape[-1] // per_step) != packed.shape[1]
        or (scales is None) != (expected_scales is None)
        or (dtype == jnp.uint8 and mins is None) or (mins is not None and dtype not in (jnp.int8, jnp.uint8))
        or (dtype == jnp.int8 and mins is not None and scales.ndim != 2)
        or (grid is not None and (dtype != jnp.uint8 or grid.shape != (16,)))
        or (scales is not None and (scales.ndim not in expected_scales or scales.ndim == 3 and scales.shape[2] != PANEL
                                    or -(-scales_width(scales) // PANEL) != packed.shape[0]))
        or (mins is not None and mins.shape != scales.shape)
    ):
        raise ValueError(
            f"packed_matmul_cpu: x {x.shape} does not match a packed weight {dtype} {packed.shape} with scales "
            f"{None if scales is None else scales.shape} and mins {None if mins is None else mins.shape}"
            f"{'' if grid is None else f' and grid {grid.shape}'} (float32 [N / {PANEL}, K, {PANEL}] or bfloat16 "
            f"[N / {PANEL}, ceil(K / 2), {2 * PANEL}] without scales; int8 [ceil(N / {PANEL}), K, {PANEL}] with scales "
            f"[N] or [K / G, N], and mins of grouped scales' shape or none; float8_e4m3fn as int8 without mins; uint8 [ceil(N / {PANEL}), K / 2, {PANEL}] "
            f"with scales and mins [K / G, N] or [N / {PANEL}, K / G, {PANEL}], and a grid [16] or none)"
        )
    if dtype in SCALED_DTYPES and scales.ndim == 2:
        check_int8_groups(x.shape[-1], scales.shape[0])
    n = packed.shape[0] * PANEL if scales is None else scales_width(scales)
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
    operands = tuple(array.astype(jnp.float32) for array in (scales, mins, grid) if array is not None)
    name = (INT8_MINS_TARGET if dtype == jnp.int8 and mins is not None else Q4_GRID_TARGET if grid is not None
            else TARGETS[dtype])
    return jax.ffi.ffi_call(target(name), out)(x.astype(jnp.float32), packed, *operands)
