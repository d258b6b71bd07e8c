"""What a model argument names: converted dirs as they are, HF dirs converted once into the cache,
GGUF files described once into the cache (served as stored), clear errors for Hub ids and missing files
(there is no download)."""

from __future__ import annotations

import pytest
from test_gguf_import import write_tiny_llama_gguf
from tiny_checkpoint import make_tiny_checkpoint

from cbjax.checkpoint import convert, gguf_import, resolve
from cbjax.checkpoint.loader import load_model


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CBJAX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_hf_directory_is_converted_once_into_the_cache_and_reused(tmp_path, cache, monkeypatch):
    hf_dir, ckpt_dir = make_tiny_checkpoint(tmp_path, "llama")
    assert resolve.resolve_model(str(ckpt_dir)) == ckpt_dir, "a converted checkpoint is used in place"
    converted = resolve.resolve_model(str(hf_dir))
    assert converted.parent == cache / "models" and (converted / "params").is_dir()
    assert (converted / "tokenizer.json").read_text() == (hf_dir / "tokenizer.json").read_text()
    _, config = load_model(converted)
    assert config.vocab_size == 320

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(convert, "convert_checkpoint", no_second_conversion)
    assert resolve.resolve_model(str(hf_dir)) == converted


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", ["Hub id", "does not download", "cbjax convert"]),
        ("model.Q4_1.gguf", ["does not exist", "GGUF file"]),
        ("./no/such/dir", ["does not exist"]),
    ],
)
def test_arguments_that_name_no_local_directory_say_how_to_prepare_one(model, words, cache):
    with pytest.raises(ValueError) as error:
        resolve.resolve_model(model)
    assert model in str(error.value) and all(word in str(error.value) for word in words)


def test_a_gguf_file_is_described_once_into_the_cache_and_served_from_its_link(tmp_path, cache, monkeypatch):
    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    described = resolve.resolve_model(str(tmp_path / "tiny.gguf"))
    assert described.parent == cache / "models" and (described / "model.gguf").resolve() == tmp_path / "tiny.gguf"
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= {p.name for p in described.iterdir()}

    def no_second_description(*args):
        raise AssertionError("described again")

    monkeypatch.setattr(gguf_import, "write_as_stored_dir", no_second_description)
    assert resolve.resolve_model(str(tmp_path / "tiny.gguf")) == described
    # `cbjax serve` resolves the file, then its engine process resolves the directory it was given
    assert resolve.resolve_model(str(described)) == described


def test_a_directory_without_weights_is_refused(tmp_path, cache):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither a converted checkpoint"):
        resolve.resolve_model(str(tmp_path))


def test_no_model_is_the_builtin_one_from_the_cache(cache, monkeypatch):
    target = cache / "models" / resolve.BUILTIN_MODEL_NAME
    (target / "params").mkdir(parents=True)
    assert resolve.resolve_model(None) == target == resolve.resolve_model("")
