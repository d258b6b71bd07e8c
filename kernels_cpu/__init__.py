"""The C++ kernels for XLA:CPU as custom calls (XLA FFI): what the engine serves with on a CPU.

- Paged attention (`paged_attention.cc`, `attention.py`). The Pallas kernels only compile for
  GPUs, and the jnp reference pays XLA:CPU's fixed cost per op on every gather and small dot of
  its fixed-shape loop. This kernel keeps the reference's contract and loops over the real tokens
  and keys only.
- A matmul over weights packed in 32-column panels (`packed_matmul.cc`, `matmul.py`): the
  skinny projections of decode steps stream the weights at the machine's rate, which XLA:CPU's
  dots do not. int8 panels with float32 scales (quantization="int8") stream a quarter of the bytes,
  4-bit nibble panels with group scales and mins (`quant4.py`: int4, GGUF Q4_0/Q4_1/Q4_K) an eighth, and
  fp8 (e4m3) panels with scales (an fp8 checkpoint's projections as stored; `e4m3.h`) a quarter.
  bfloat16 panels multiply on AMX tiles where the CPU has them, with the bf16 dot instruction
  (vdpbf16ps) elsewhere, widened to float32 without it (`bf16_matmul_path()` says which).

Both are compiled into one library, once per machine, with the system's C++ compiler into a
cache folder (`build.py`) and registered with XLA as FFI targets (`registry.py`); where they cannot
be built, `kernel_problem()` says why and the engine serves with the jnp paths instead.
"""

from kernels_cpu.attention import ragged_paged_attention_cpu, write_kv_and_attend_cpu
from kernels_cpu.matmul import (
    LAYOUT,
    group_rows_packable,
    pack_group_rows,
    pack_weight,
    packable,
    packed_matmul_cpu,
    packed_matmul_reference,
    scales_width,
    unpack_group_rows,
    unpack_weight,
)
from kernels_cpu.registry import (
    bf16_matmul_path,
    build_hash,
    kernel_problem,
    kernel_registered,
    register_in_background,
    registration_deferred,
)

__all__ = [
    "LAYOUT",
    "bf16_matmul_path",
    "build_hash",
    "group_rows_packable",
    "kernel_problem",
    "kernel_registered",
    "pack_group_rows",
    "pack_weight",
    "packable",
    "packed_matmul_cpu",
    "packed_matmul_reference",
    "ragged_paged_attention_cpu",
    "register_in_background",
    "registration_deferred",
    "scales_width",
    "unpack_group_rows",
    "unpack_weight",
    "write_kv_and_attend_cpu",
]
