"""Wrong types and vLLM options cbjax lacks get errors that name the argument, the value and what is accepted."""

from __future__ import annotations

import pytest
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams
from cbjax.config import EngineConfig

OPTIONS = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, block_size=8, num_kv_blocks=40)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("messages"))[1])


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, **OPTIONS)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": "hot"}, r"temperature must be a number \(int or float\), got 'hot' \(str\)"),
    ({"top_p": None}, r"top_p must be a number \(int or float\), got None \(NoneType\)"),
    ({"max_tokens": 1.5}, r"max_tokens must be an int, got 1.5 \(float\)"),
    ({"seed": "7"}, r"seed must be an int, got '7' \(str\)"),
])
def test_sampling_params_wrong_type_is_a_type_error_naming_it(kwargs, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=message):  # also a ValueError, as every bad value is
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"best_of": 2}, {"use_beam_search": True}, {"truncate_prompt_tokens": 5}])
def test_vllm_sampling_options_cbjax_lacks_say_so(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=rf"SamplingParams\({name}=.*is a vLLM option that cbjax does not support"):
        SamplingParams(**kwargs)


def test_vllm_sampling_option_at_its_default_changes_nothing():
    assert SamplingParams(best_of=None, use_beam_search=False, temperature=0.5) == SamplingParams(temperature=0.5)


@pytest.mark.parametrize("kwargs, message", [
    ({"quantization": "awq"}, r"quantization='awq' is not supported; use one of \('int8', 'int4', 'int4-g64', 'int4-g32'\) or None"),
    ({"kv_cache_dtype": "fp8_e5m2"}, r"kv_cache_dtype='fp8_e5m2' is not supported; use one of 'auto', 'float32', "
                                     r"'bfloat16', 'float16', 'fp8', 'fp8_e4m3'"),
    ({"trust_remote_code": True}, r"LLM\(trust_remote_code=True\) is a vLLM option that cbjax does not support"),
    ({"pipeline_parallel_size": 2}, r"LLM\(pipeline_parallel_size=2\) is a vLLM option that cbjax does not support"),
    ({"max_num_seqs": "8"}, r"max_num_seqs must be an int, got '8' \(str\)"),
    ({"gpu_memory_utilization": "most"}, r"gpu_memory_utilization must be a number .*got 'most' \(str\)"),
    ({"no_such_option": 1}, r"unsupported options \['no_such_option'\]; supported: \["),
])
def test_llm_options_cbjax_lacks_or_of_the_wrong_type_are_refused_before_loading(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        LLM("no/such/checkpoint", **kwargs)


def test_engine_config_takes_a_path_for_the_model(tmp_path):
    assert EngineConfig(model=tmp_path).model == str(tmp_path)


@pytest.mark.parametrize("prompts, message", [
    (123, r"prompts must be a prompt \(a str, a dict with 'prompt' \(vLLM's TextPrompt\) or with 'prompt_token_ids' "
          r"\(TokensPrompt\)\) or a list of them; got 123 \(int\)"),
    (["fine", 5], r"prompt 1: a prompt must be a str, a dict with 'prompt' \(vLLM's TextPrompt\) or with "
                  r"'prompt_token_ids' \(TokensPrompt\), got 5 \(int\)"),
    ([{"prompt_token_ids": [1, 2.5]}], r"prompt 0: prompt_token_ids must be a list of ints; item 1 is 2.5 \(float\)"),
    ([{"prompt_token_ids": "1 2"}], r"prompt 0: prompt_token_ids must be a list of ints, got '1 2' \(str\)"),
])
def test_generate_wrong_prompt_types_name_the_prompt(llm, prompts, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, use_tqdm=False)


def test_generate_wrong_sampling_params_type(llm):
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams or a list of them, got \{'temperature'"):
        llm.generate("hello", {"temperature": 0.0}, use_tqdm=False)


def test_one_bad_prompt_rejects_the_batch_naming_its_index_and_leaks_nothing(llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    bad = {"prompt_token_ids": [5, 999]}  # the tiny vocabulary has 320 ids
    with pytest.raises(ValueError, match=r"prompt 2 of 3: prompt token id 999 is outside the vocabulary \[0, 320\)"):
        llm.generate([good, good, bad], SamplingParams(max_tokens=3), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    (out,) = llm.generate([good], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
