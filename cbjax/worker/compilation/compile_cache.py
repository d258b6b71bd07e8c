"""The persistent XLA compilation cache: on by default, so a machine compiles each step once.

JAX keys every executable by its HLO, jaxlib's version, the backend's version, XLA flags and
compile options; weights are arguments of the steps, so a model of the same shapes reuses
them safely. Its key does not cover the CPU's instruction set (XLA:CPU compiles for the host's
features), so the default folder is one per jax version, device and CPU feature set: a cache
folder shared between machines never hands one an executable built for another. The C++
kernels' build hash is in their FFI target names, hence in the steps' HLO (see
kernels_cpu/registry.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import re
import tempfile
import threading
from collections.abc import Iterable
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

from cbjax.paths import cache_dir
from kernels_cpu import build_hash
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


# LLVM's optimization level for XLA:CPU's generated code: 1 instead of XLA's default 2 compiles the step
# programs sooner and the steps run as fast; level 0 compiles sooner still but its steps run slower
# (`python -m benchmarks.step_compile_times --options ... --calls N`, BENCHMARKS.md, "Start-up and compile times").
# The dots and the attention are library calls (Eigen, oneDNN, the C++ kernel): only fusions are
# generated, and those are memory-bound.
CPU_COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 1}


def step_compiler_options(platform: str) -> dict[str, Any]:
    """XLA options every step program is compiled with on `platform` (part of JAX's cache key); a
    level given in $XLA_FLAGS wins (the test suite sets 0: tiny models' steps cost nothing to run)."""
    if platform != "cpu" or "--xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return dict(CPU_COMPILER_OPTIONS)


_thread_state = threading.local()  # set by JAX's cache-hit event, in the thread that compiles


def _note_cache_hit(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _thread_state.cache_hit = True


jax.monitoring.register_event_listener(_note_cache_hit)

# The packages whose code a step is traced from: a step's own cache key covers all their sources.
TRACED_PACKAGES = ("cbjax", "kernels_cpu", "kernels_pallas")
SOURCE_SUFFIXES = (".py", ".cc", ".h")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of every source file a step's program can come from (cbjax and both kernel packages)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    key = hashlib.sha256()
    for package in TRACED_PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                key.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return key.hexdigest()


class StepCache:
    """Compiled steps stored whole, keyed without tracing them, so a warm start skips tracing too.

    JAX's persistent cache keys an executable by its HLO, so every start traces and lowers each
    step first, which took longer than loading it for SmolLM2 (`python -m benchmarks.startup_timeline`). This cache keys a step by what
    its program is made from: the sources of the packages it is traced from, the jax version,
    device and CPU (the folder, see compile_cache_folder), XLA flags and jax's settings, the
    model's structure and the shapes, dtypes and shardings of every argument. A key it does not
    have falls through to tracing and a fresh compile, then stores the executable: the runner
    names each step program after its key here, so JAX's cache cannot hand back one compiled
    under another key (see compile_fresh for why that one could not be stored).

    A stored step is loaded onto `device`, the one device the engine runs on: left to itself,
    deserialize_and_load loads an executable onto every local device, and on a host with more
    than one (a multi-GPU machine, or forced host devices) a one-device step loaded that way
    refuses its one-device arguments ("expected args to have 4 shards").
    """

    def __init__(self, folder: pathlib.Path, device: jax.Device):
        self.folder = folder / "steps"
        self.device = device

    @staticmethod
    def key(parts: Iterable[Any]) -> str:
        digest = hashlib.sha256()
        settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k and "log" not in k)
        for part in (code_fingerprint(), os.environ.get("XLA_FLAGS", ""), repr(settings), *parts):
            # Object addresses in reprs (functions held by the model's structure) differ between processes.
            digest.update(re.sub(r" at 0x[0-9a-f]+", "", str(part)).encode() + b"\0")
        return digest.hexdigest()[:32]

    @staticmethod
    def kernel_build(backend: str) -> str:
        """The C++ kernel build a step calls (its FFI targets are named after it); "" for other backends."""
        return build_hash() if backend == "cpp" else ""

    @staticmethod
    def compile_fresh(lowered: jax.stages.Lowered, options: dict[str, Any] | None = None) -> tuple[Any, bool]:
        """Compile (with XLA `options`, see step_compiler_options); whether XLA really compiled it
        (not JAX's persistent cache).

        Only fresh executables are stored: one that JAX's cache handed back serializes without
        some of its fused functions' code (on jaxlib 0.10.2 its copy failed to run: "Function
        slice_bitcast-convert_fusion.1 not found").
        """
        _thread_state.cache_hit = False
        compiled = lowered.compile(compiler_options=options or None)
        return compiled, not _thread_state.cache_hit

    def has(self, key: str) -> bool:
        return (self.folder / f"{key}.step").is_file()

    def load(self, key: str) -> Any | None:
        """The stored executable, or None (missing, or unreadable by this jaxlib: it is compiled again)."""
        path = self.folder / f"{key}.step"
        if not path.is_file():
            return None
        try:
            return serialize_executable.deserialize_and_load(
                *pickle.loads(path.read_bytes()), backend=self.device.client, execution_devices=[self.device])
        except Exception as error:  # noqa: BLE001 - a bad entry costs a compile, never a failed start
            logger.warning("ignoring the cached step %s (%s: %s); compiling it again", path, type(error).__name__, error)
            return None

    def store(self, key: str, compiled: Any) -> None:
        try:
            self._write(f"{key}.step", pickle.dumps(serialize_executable.serialize(compiled)))
        except (OSError, ValueError, NotImplementedError) as error:
            logger.warning("could not store a compiled step in %s (%s); the next start traces it again", self.folder, error)

    def recall_number(self, key: str) -> int | None:
        """A number stored by remember_number under `key` (a measurement of steps with that key), or None."""
        try:
            return int((self.folder / f"{key}.number").read_text())
        except (OSError, ValueError):
            return None

    def remember_number(self, key: str, value: int) -> None:
        try:
            self._write(f"{key}.number", str(int(value)).encode())
        except OSError as error:
            logger.warning("could not store a step measurement in %s (%s); the next start measures it again", self.folder, error)

    def _write(self, name: str, blob: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        handle, scratch = tempfile.mkstemp(dir=self.folder, prefix=f".{name}-")
        with os.fdopen(handle, "wb") as file:
            file.write(blob)
        os.replace(scratch, self.folder / name)  # readers see a whole entry or none
