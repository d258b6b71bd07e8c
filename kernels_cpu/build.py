"""Compile the C++ kernels (`paged_attention.cc`, `packed_matmul.cc`) into one shared library,
once per machine, source and jaxlib.

The library goes to $CBJAX_KERNEL_CACHE (default: `kernels/` in cbjax's cache folder,
$CBJAX_CACHE_DIR or ~/.cache/cbjax) under a name hashed from the source, the flags, the
compiler, jaxlib's version and this CPU's feature flags: a change to any of them builds anew,
and a folder shared between machines never hands one a library built for another's instruction set (`-march=native`). The compiler is $CXX or `c++`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile


SOURCES = tuple(pathlib.Path(__file__).with_name(name) for name in ("paged_attention.cc", "packed_matmul.cc"))
HEADERS = tuple(pathlib.Path(__file__).with_name(name) for name in ("work_sharing.h", "e4m3.h"))  # included by the sources: part of the build's hash
# -fassociative-math (with the two flags it needs) lets the compiler vectorise the dot and sum
# reductions; it keeps infinities and NaN, unlike -ffast-math.
FLAGS = (
    "-O3", "-std=c++17", "-shared", "-fPIC", "-march=native", "-fno-math-errno",
    "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
)


class KernelBuildError(RuntimeError):
    pass


def cache_dir() -> pathlib.Path:
    """$CBJAX_KERNEL_CACHE, else cbjax's cache folder/kernels, else (no writable home) a folder in the temp dir."""
    if os.environ.get("CBJAX_KERNEL_CACHE"):
        return pathlib.Path(os.environ["CBJAX_KERNEL_CACHE"])
    # Imported here: `import cbjax` pulls in the engine, whose model imports the kernels, so a
    # module-level import would make `import cbjax.models.layers.attention` alone a circular import.
    from cbjax.paths import cache_dir as cbjax_cache_dir

    try:
        home = cbjax_cache_dir() / "kernels"
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return pathlib.Path(tempfile.gettempdir()) / f"cbjax-kernels-{os.getuid()}"


def compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        raise KernelBuildError(
            f"no C++ compiler: {cxx!r} is not on PATH; install one (e.g. `apt install g++`) or set CXX"
        )
    return cxx


def cpu_features() -> str:
    """This CPU's feature flags line from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=None)
def compiler_version(cxx: str) -> str:
    """`cxx --version`, asked once per process (a step's trace names the build on every layer)."""
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout


def library_path(cxx: str) -> pathlib.Path:
    import jaxlib

    version = compiler_version(cxx)
    key = hashlib.sha256()
    for part in (*(source.read_bytes() for source in (*SOURCES, *HEADERS)), " ".join(FLAGS).encode(), version.encode(), jaxlib.__version__.encode(),
                 cpu_features().encode()):
        key.update(part)
    return cache_dir() / f"cbjax_cpu_kernels_{key.hexdigest()[:16]}.so"


def build() -> pathlib.Path:
    """The library's path, compiling it first if this machine has none (about 4 s)."""
    import jax.ffi

    cxx = compiler()
    target = library_path(cxx)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: concurrent builds (test workers) never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    # One translation unit that includes every source: XLA's FFI headers, most of the compile
    # time, are parsed once, and one compiler leaves the other cores to the engine's start-up.
    unit = "".join(f'#include "{source.resolve()}"\n' for source in SOURCES)
    command = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", "-x", "c++", "-", "-o", tmp]
    result = subprocess.run(command, input=unit, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        os.unlink(tmp)
        names = ", ".join(source.name for source in SOURCES)
        raise KernelBuildError(f"compiling {names} failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    os.replace(tmp, target)
    return target
