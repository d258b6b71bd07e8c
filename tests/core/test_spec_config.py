"""speculative_config: vLLM's names and defaults; a bad value names the field, the value and the limit."""

import pytest

from cbjax.config import EngineConfig
from cbjax.core.spec.config import SpeculativeConfig


def test_json_and_dict_forms_take_vllms_defaults():
    ngram = EngineConfig(model="m", speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                                      '"prompt_lookup_max": 4}').speculative_config
    assert (ngram.method, ngram.num_speculative_tokens, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("ngram", 3, 4, 4)
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    suffix = SpeculativeConfig.of({"method": "suffix", "suffix_decoding_max_tree_depth": 8})
    assert suffix.num_speculative_tokens == 8  # vLLM: k defaults to the tree depth
    draft = SpeculativeConfig.of('{"model": "draft", "num_speculative_tokens": 3}')
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "draft", 3)  # vLLM: a model alone


@pytest.mark.parametrize("options, words", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 exceeds prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "['draft_model'] are not supported"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2.0}, "suffix_decoding_min_token_prob=2.0 must be in [0, 1]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_num_speculative_tokens": 1},
     "adaptive_num_speculative_tokens=1 must be true or false"),
    ("{not json", "is not JSON"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "method 'draft_model' takes the draft's checkpoint directory"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "d"}, "method='ngram' with model='d'"),
    ({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size=2 is not supported: the draft model runs on one device"),
])
def test_bad_values_name_the_field_value_and_limit(options, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")):
        EngineConfig(model="m", speculative_config=options)
