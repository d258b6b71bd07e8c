"""`cbjax convert` (Hugging Face safetensors -> orbax) and `cbjax import-gguf` (GGUF -> Hugging Face)."""

from __future__ import annotations

import argparse


def cmd_convert(args: argparse.Namespace) -> None:
    from cbjax.checkpoint.convert import convert_checkpoint

    out = convert_checkpoint(args.hf_dir, args.out, args.dtype)
    print(f"converted {args.hf_dir} -> {out}")


def cmd_import_gguf(args: argparse.Namespace) -> None:
    from cbjax.checkpoint.gguf_import import import_gguf

    out = import_gguf(args.gguf_file, args.out_hf_dir)
    print(f"imported {args.gguf_file} -> {out} (a Hugging Face directory; next: cbjax convert {out})")


def add_convert_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="Hugging Face safetensors directory -> checkpoints/NAME (orbax)")
    p.add_argument("hf_dir")
    p.add_argument("--out", default=None, help="output directory (default checkpoints/<name>)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("import-gguf", help="llama GGUF file -> Hugging Face directory (safetensors + tokenizer)")
    p.add_argument("gguf_file")
    p.add_argument("out_hf_dir")
    p.set_defaults(func=cmd_import_gguf)
