"""Write a GGUF file with llama.cpp's own quantizer (llama-cpp-python in the peer venv: `python -m
cbjax.bench.peers --install llamacpp`), for serving K-quant files as stored where no such file installs offline.

    python -m benchmarks.llamacpp_quantize downloads/SmolLM2-135M-Instruct.Q4_1.gguf \
        downloads/SmolLM2-135M-Instruct.Q4_K_M.gguf Q4_K_M

The type is a llama.cpp file type (LLAMA_FTYPE_MOSTLY_<TYPE>: Q4_K_M, Q5_K_M, Q6_K, Q8_0, ...). The source may
itself be quantized (requantized, as llama-quantize --allow-requantize does). Where a K-quant's superblock of
256 does not divide a row (SmolLM2's 576), llama.cpp falls back to another type for that tensor and says so.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

# Runs in the peer venv (llama_cpp there, no cbjax): argv = source, destination, file type.
QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.nthread = 2
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def main() -> None:
    from cbjax.bench.peers import venv_python

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path)
    p.add_argument("destination", type=Path)
    p.add_argument("type", help="llama.cpp file type, e.g. Q4_K_M")
    args = p.parse_args()
    python = venv_python("llamacpp")
    if not python.exists():
        raise SystemExit(f"no llama.cpp peer venv at {python}: run `python -m cbjax.bench.peers --install llamacpp` "
                         f"(or set CBJAX_PEER_VENVS to where one is)")
    done = subprocess.run([str(python), "-c", QUANTIZE, str(args.source.resolve()), str(args.destination.resolve()),
                           args.type.upper()])
    if done.returncode:
        raise SystemExit(f"llama.cpp's quantizer exited {done.returncode} writing {args.destination}")
    print(f"wrote {args.destination} ({args.type.upper()}, {args.destination.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
