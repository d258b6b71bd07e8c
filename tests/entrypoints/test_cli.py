"""The CLI on a tiny checkpoint: lowering every step for CUDA without a GPU (from the checkpoint or
from its config alone), and streaming generate."""

from __future__ import annotations

import logging

import pytest
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams
from cbjax.entrypoints.cli.main import main
from cbjax.worker.compilation.compile_cache import DISABLE_ENV

ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-model-len", "64", "--max-num-batched-tokens", "32", "--block-size", "16",
                "--dtype", "float32", "--num-kv-blocks", "40"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("cli"), "llama")[1])


def test_lower_every_bucket_for_cuda_with_the_pallas_kernels(checkpoint, capsys):
    main(["lower", "--platform", "cuda", "--backend", "pallas", "--model", checkpoint, *ENGINE_FLAGS])
    out = capsys.readouterr().out
    # 4 seqs / 32 tokens: decode (4), mixed (16 tokens, 4 reqs), mixed (32 tokens, 4 reqs).
    assert "lowered 3/3 steps for cuda with backend pallas" in out


def test_lower_from_a_config_alone_and_refuses_both_or_neither(checkpoint, capsys, tmp_path, monkeypatch):
    # With the compilation cache on, as for a user (the step cache once asked a shape for its device).
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.setenv("CBJAX_CACHE_DIR", str(tmp_path))
    main(["lower", "--platform", "cuda", "--config", checkpoint, *ENGINE_FLAGS])  # config.json of the checkpoint
    out = capsys.readouterr().out
    assert "lowered 3/3 steps for cuda with backend pallas at tensor_parallel_size=1" in out
    assert out.count(": 1 partitions; ") == 3  # one line per bucket
    for flags in (["--config", checkpoint, "--model", checkpoint], []):
        with pytest.raises(SystemExit, match="give either --model CHECKPOINT or --config"):
            main(["lower", *flags, *ENGINE_FLAGS])


def test_generate_streams_what_the_api_returns(checkpoint, capsys, caplog):
    """generate compiles only the steps its prompt runs in; a missed one would be compiled on demand, with a warning."""
    prompt = "Once upon a time there was a tiny model that spoke in riddles."
    with caplog.at_level(logging.WARNING, logger="cbjax.worker.model_runner"):
        main(["generate", "--model", checkpoint, *ENGINE_FLAGS, "--prompt", prompt, "--max-tokens", "12"])
    assert not caplog.records
    streamed = capsys.readouterr().out
    llm = LLM(checkpoint, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, block_size=16, dtype="float32", num_kv_blocks=40)
    assert 32 < len(llm.get_tokenizer().encode(prompt)) <= 64 - 12  # two prompt chunks: 32 tokens, then the rest
    (out,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert streamed == out.outputs[0].text + "\n"
