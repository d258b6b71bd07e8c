"""The persistent XLA compilation cache: on by default, so a machine compiles each step once.

JAX keys every executable by its HLO, jaxlib's version, the backend's version, XLA flags and
compile options; weights are arguments of the steps, so a model of the same shapes reuses
them safely. Its key does not cover the CPU's instruction set (XLA:CPU compiles for the host's
features), so the default folder is one per jax version, device and CPU feature set: a cache
folder shared between machines never hands one an executable built for another. The C++
attention kernel's build hash is in its FFI target names, hence in the steps' HLO (see
kernels_cpu/attention.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib

import jax
import jaxlib
from jax.experimental.compilation_cache import compilation_cache

from cbjax.paths import cache_dir
from kernels_cpu.build import cpu_features

logger = logging.getLogger(__name__)

AUTO = "auto"
DISABLE_ENV = "CBJAX_DISABLE_COMPILE_CACHE"


def machine_key(device: jax.Device) -> str:
    """A short hash of what an executable is built for besides its HLO: jax, device, CPU features."""
    key = hashlib.sha256()
    for part in (jax.__version__, jaxlib.__version__, device.platform, device.device_kind, cpu_features()):
        key.update(part.encode())
    return key.hexdigest()[:16]


def compile_cache_folder(setting: str | None, device: jax.Device) -> pathlib.Path | None:
    """Where compiled steps are kept: "auto" = cache_dir()/xla/<machine key>, a path, or None (off)."""
    if setting is None or os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    if setting == AUTO:
        return cache_dir() / "xla" / machine_key(device)
    return pathlib.Path(setting)


def enable_compile_cache(setting: str | None, device: jax.Device) -> pathlib.Path | None:
    """Point JAX's persistent cache at the folder for `setting`; None leaves JAX's own settings alone."""
    folder = compile_cache_folder(setting, device)
    if folder is None:
        logger.info("persistent compilation cache: off (compilation_cache_dir=None or %s=1)", DISABLE_ENV)
        return None
    folder.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != str(folder):
        compilation_cache.reset_cache()  # JAX opens its cache once per process: reopen it at the new folder
        jax.config.update("jax_compilation_cache_dir", str(folder))
    # Every step counts: even a 0.2 s compile is worth keeping when start-up runs dozens.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    logger.info("persistent compilation cache: %s", folder)
    return folder
