"""An fp8 checkpoint of a float Hugging Face directory, as llm-compressor's FP8 scheme writes one (e4m3 decoder
projections, a scale per output row, static input scales, compressed-tensors' quantization_config), for
`benchmarks.quantization --fp8`:

    python -m benchmarks.fp8_quantize downloads/smollm2-135m-instruct-hf downloads/smollm2-135m-instruct-fp8

Also writes OUT-float: the same weights dequantized by torch (q.float() * scale), float32, no quantization_config.
The writer is the tests' (tests/fp8_checkpoints.py), so the benchmark serves what the tests check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fp8_checkpoints import FORMS, write_fp8_checkpoint  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hf_dir", type=Path, help="a float Hugging Face directory (one model.safetensors)")
    p.add_argument("out", type=Path, help="the fp8 checkpoint's directory (must not exist)")
    p.add_argument("--form", default="per-row", choices=list(FORMS))
    args = p.parse_args()
    print(write_fp8_checkpoint(args.hf_dir, args.out, args.form))


if __name__ == "__main__":
    main()
