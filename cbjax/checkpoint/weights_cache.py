"""A memory-mapped copy of a checkpoint's weights, written on its first load and mapped by later ones.

Restoring SmolLM2's 540 MB of float32 weights through orbax took seconds (`python -m
benchmarks.startup_timeline`), and the restored host arrays plus their device copies held the
weights twice. XLA:CPU takes a 64-byte-aligned host array as a device buffer without copying it
(`device_put(may_alias=True)`), so weights mapped from one file are loaded in milliseconds, never
copied, and read from the page cache as the first steps touch them. The file is a standard
safetensors file whose tensors start on 64-byte boundaries; it lives in `cache_dir()/weights/`,
keyed by the checkpoint's path, its files' sizes and times, the dtype and the model's parameter set,
so a re-converted checkpoint or a changed model never maps a stale copy (the stale file of that
checkpoint and dtype is deleted when the new one is written).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from cbjax.paths import cache_dir

logger = logging.getLogger(__name__)

DISABLE_ENV = "CBJAX_DISABLE_WEIGHTS_CACHE"
ALIGNMENT = 64  # XLA:CPU aliases host arrays aligned to this; others it copies
FORMAT_VERSION = "1"
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
NUMPY_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}


def cached_weights(
    params_dir: Path, dtype: str, expected: dict[str, jax.ShapeDtypeStruct], restore: Callable[[], dict[str, np.ndarray]],
    layout: tuple[str, Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]] | None = None,
) -> dict[str, np.ndarray]:
    """The checkpoint's weights in `dtype`, mapped from the cache; on a miss `restore()` reads them
    (already checked against `expected`) and they are written to the cache first.

    layout: (its name, a function that rearranges restored weights into it), e.g. projections
    packed for the CPU matmul kernel; cached apart from the checkpoint's own layout.
    With $CBJAX_DISABLE_WEIGHTS_CACHE=1, or where the cache cannot be written, the restored arrays.
    """
    layout_name, arrange = layout or ("", lambda params: params)
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return arrange(restore())
    folder = cache_dir() / "weights"
    source = str(params_dir.resolve())
    source_key = hashlib.sha256(source.encode()).hexdigest()[:16]
    prefix = f"{source_key}-{dtype}{'.' + layout_name if layout_name else ''}-"  # one file per checkpoint, dtype and layout
    path = folder / f"{prefix}{_content_key(params_dir, dtype, expected)}.safetensors"
    if not path.is_file():
        params = arrange(restore())
        try:
            write_weights(path, {name: array.astype(jnp.dtype(dtype), copy=False) for name, array in params.items()})
        except OSError as error:
            warnings.warn(f"could not write the weights cache {path} ({error}); loading without it", stacklevel=3)
            return params
        del params  # the mapped file replaces them: one copy of the weights in memory
        for stale in folder.glob(f"{prefix}*.safetensors"):
            if stale != path:
                stale.unlink(missing_ok=True)
        logger.info("weights of %s cached in %s", source, path)
    return map_weights(path)


def _content_key(params_dir: Path, dtype: str, expected: dict[str, jax.ShapeDtypeStruct]) -> str:
    """What the cached copy depends on: the checkpoint's files (sizes, times), the dtype, the model's parameters."""
    key = hashlib.sha256(f"{FORMAT_VERSION}\n{dtype}\n".encode())
    for file in sorted(p for p in params_dir.rglob("*") if p.is_file()):
        stat = file.stat()
        key.update(f"{file.relative_to(params_dir)} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    for name, spec in sorted(expected.items()):
        key.update(f"{name} {tuple(spec.shape)} {np.dtype(spec.dtype)}\n".encode())
    return key.hexdigest()[:16]


def write_weights(path: Path, params: dict[str, np.ndarray]) -> None:
    """Write `params` as one safetensors file, atomically, each tensor starting 64-byte aligned.

    safetensors allows no gaps between tensors: those whose size is a multiple of ALIGNMENT go
    first (every weight matrix), so only the small odd-sized ones at the end can be unaligned.
    """
    names = sorted(params, key=lambda name: (params[name].nbytes % ALIGNMENT != 0, name))
    header, offset = {}, 0
    for name in names:
        array = params[name]
        header[name] = {"dtype": SAFETENSORS_DTYPES[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)  # the data section starts aligned
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(len(text).to_bytes(8, "little") + text)
            for name in names:
                file.write(np.ascontiguousarray(params[name]).reshape(-1).view(np.uint8).data)
        os.replace(scratch, path)  # readers see the whole file or none
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def map_weights(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as an array over one copy-on-write mapping of it."""
    data = np.memmap(path, np.uint8, mode="c")
    header_len = int.from_bytes(data[:8].tobytes(), "little")
    header = json.loads(data[8 : 8 + header_len].tobytes())
    header.pop("__metadata__", None)
    start = 8 + header_len
    return {
        name: data[start + entry["data_offsets"][0] : start + entry["data_offsets"][1]]
        .view(NUMPY_DTYPES[entry["dtype"]])
        .reshape(entry["shape"])
        for name, entry in header.items()
    }
