"""The requests `python -m benchmarks.diff_vllm` sends to both engines; add a dict to extend it.

A case is {"name", "prompt", "params", optional "compare"}:
- "prompt": a string, {"prompt_token_ids": [...]}, or {"chat": [messages]} (each engine renders
  the conversation with the model's chat template itself, so template parity is checked too);
- "params": SamplingParams fields by vLLM's names, passed unchanged to both engines (a field one
  engine lacks or a value it refuses shows up as a refusal on that side);
- "compare": "exact" (default: token ids, text, finish/stop reason, logprobs), "first_logprobs"
  (sampled requests: different RNGs, so only what the prompt fixes: the number of outputs, their
  lengths when forced, and the first position's top-N logprobs), or {"repeatable_with": NAME}
  (each engine must give this case the same outputs it gave case NAME).

The stop cases are built on SmolLM2-135M-Instruct's greedy answer to CHAT_FRANCE,
"The capital of France is Paris." = "The", " capital", " of", " France", " is", " Paris", ".",
then <|im_end|> (id 2, the EOS).
"""

from __future__ import annotations

CHAT_FRANCE = {"chat": [{"role": "user", "content": "What is the capital of France?"}]}
CHAT_MULTI_TURN = {"chat": [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Name another one."},
]}
ONCE = "Once upon a time"
SPECIALS_IN_TEXT = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
PARIS_TOKEN_ID = 7042  # " Paris" in SmolLM2's vocabulary (checked by the stop_token_id cases' outputs)

GREEDY = {"temperature": 0.0}

CASES: list[dict] = [
    # plain greedy, prompts as text, token ids and chat
    {"name": "greedy_text", "prompt": ONCE, "params": GREEDY | {"max_tokens": 32}},
    {"name": "greedy_token_ids", "prompt": {"prompt_token_ids": [6403, 1980, 253, 655]}, "params": GREEDY | {"max_tokens": 24}},
    {"name": "max_tokens_1", "prompt": ONCE, "params": GREEDY | {"max_tokens": 1}},
    {"name": "chat_eos", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 32}},
    {"name": "chat_multi_turn", "prompt": CHAT_MULTI_TURN, "params": GREEDY | {"max_tokens": 32}},
    # the EOS token: its text, ignore_eos, min_tokens
    {"name": "eos_kept_specials", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 32, "skip_special_tokens": False}},
    {"name": "eos_include_stop_str", "prompt": CHAT_FRANCE,
     "params": GREEDY | {"max_tokens": 32, "skip_special_tokens": False, "include_stop_str_in_output": True}},
    {"name": "ignore_eos", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 20, "ignore_eos": True}},
    {"name": "ignore_eos_kept_specials", "prompt": CHAT_FRANCE,
     "params": GREEDY | {"max_tokens": 20, "ignore_eos": True, "skip_special_tokens": False}},
    {"name": "min_tokens_past_eos", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 24, "min_tokens": 12}},
    # stop strings
    {"name": "stop_str", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 32, "stop": ["France"]}},
    {"name": "stop_str_included", "prompt": CHAT_FRANCE,
     "params": GREEDY | {"max_tokens": 32, "stop": ["France"], "include_stop_str_in_output": True}},
    {"name": "stop_str_first_of_many", "prompt": ONCE, "params": GREEDY | {"max_tokens": 32, "stop": ["Haven", "city"]}},
    {"name": "stop_str_on_first_token", "prompt": ONCE, "params": GREEDY | {"max_tokens": 32, "stop": [".", ","]}},
    {"name": "stop_str_on_last_token", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 6, "stop": ["Paris"]}},
    {"name": "stop_str_before_min_tokens", "prompt": CHAT_FRANCE,
     "params": GREEDY | {"max_tokens": 16, "min_tokens": 4, "stop": ["capital"]}},
    {"name": "stop_str_inside_token", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 32, "stop": ["ari"]}},
    # stop_token_ids
    {"name": "stop_token_id", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 32, "stop_token_ids": [PARIS_TOKEN_ID]}},
    {"name": "stop_token_id_included", "prompt": CHAT_FRANCE,
     "params": GREEDY | {"max_tokens": 32, "stop_token_ids": [PARIS_TOKEN_ID], "include_stop_str_in_output": True}},
    # special tokens written in a text prompt
    {"name": "specials_in_prompt", "prompt": SPECIALS_IN_TEXT, "params": GREEDY | {"max_tokens": 16}},
    {"name": "specials_in_prompt_kept", "prompt": SPECIALS_IN_TEXT,
     "params": GREEDY | {"max_tokens": 16, "ignore_eos": True, "skip_special_tokens": False}},
    # logprobs (raw logits in both engines)
    {"name": "logprobs_0", "prompt": ONCE, "params": GREEDY | {"max_tokens": 16, "logprobs": 0}},
    {"name": "logprobs_5", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 16, "logprobs": 5}},
    {"name": "logprobs_5_stop_str", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 16, "logprobs": 5, "stop": ["Paris"]}},
    {"name": "prompt_logprobs_3", "prompt": ONCE, "params": GREEDY | {"max_tokens": 4, "prompt_logprobs": 3}},
    # penalties under greedy decoding
    {"name": "repetition_penalty", "prompt": ONCE, "params": GREEDY | {"max_tokens": 32, "repetition_penalty": 1.3}},
    {"name": "presence_frequency_penalty", "prompt": ONCE,
     "params": GREEDY | {"max_tokens": 32, "presence_penalty": 1.5, "frequency_penalty": 1.0}},
    # the penalised choice is not the raw argmax: logprobs (raw) must give its true rank
    {"name": "repetition_penalty_logprobs", "prompt": ONCE, "params": GREEDY | {"max_tokens": 32, "repetition_penalty": 1.3, "logprobs": 1}},
    {"name": "repetition_penalty_chat", "prompt": CHAT_MULTI_TURN, "params": GREEDY | {"max_tokens": 32, "repetition_penalty": 1.5}},
    # sampling that collapses to one token per step: comparable token for token
    {"name": "sampled_top_k_1", "prompt": ONCE, "params": {"temperature": 0.8, "top_k": 1, "seed": 3, "max_tokens": 16, "logprobs": 2}},
    {"name": "sampled_top_p_tiny", "prompt": ONCE, "params": {"temperature": 1.0, "top_p": 0.01, "seed": 4, "max_tokens": 16}},
    {"name": "sampled_min_p_high", "prompt": CHAT_FRANCE, "params": {"temperature": 1.0, "min_p": 0.999, "seed": 5, "max_tokens": 16}},
    # seeded sampling: different RNGs, so compare what the prompt fixes and each engine's repeatability
    {"name": "seeded", "prompt": ONCE, "compare": "first_logprobs",
     "params": {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 16, "ignore_eos": True, "logprobs": 5}},
    {"name": "seeded_again", "prompt": ONCE, "compare": {"repeatable_with": "seeded"},
     "params": {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 16, "ignore_eos": True, "logprobs": 5}},
    # n > 1: vLLM-CPU refuses it with greedy sampling; sampled, the prompt fixes the first logprobs
    {"name": "n2_sampled", "prompt": ONCE, "compare": "first_logprobs",
     "params": {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 8, "ignore_eos": True, "logprobs": 3}},
    # vLLM-CPU refuses n > 1 with greedy sampling; cbjax takes it (issue 13): its n outputs must be equal
    {"name": "n2_greedy", "prompt": ONCE, "params": GREEDY | {"n": 2, "max_tokens": 8}, "compare": "cbjax_extends"},
    # logit_bias (token id -> added to its logit; JSON carries the ids as strings, run_cases makes them ints),
    # allowed_token_ids, bad_words (token sequences that may not be completed; vLLM tokenizes each word
    # with and without a leading space)
    {"name": "logit_bias_ban_paris", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 24, "logit_bias": {PARIS_TOKEN_ID: -100.0}}},
    {"name": "logit_bias_push_paris", "prompt": ONCE, "params": GREEDY | {"max_tokens": 16, "logit_bias": {PARIS_TOKEN_ID: 9.0, 13: -5.0}}},
    # logprobs stay the raw ones, before the bias
    {"name": "logit_bias_logprobs", "prompt": CHAT_FRANCE,
     "params": GREEDY | {"max_tokens": 12, "logit_bias": {PARIS_TOKEN_ID: -100.0}, "logprobs": 2}},
    {"name": "allowed_token_ids", "prompt": CHAT_FRANCE,
     "params": GREEDY | {"max_tokens": 8, "allowed_token_ids": [2, 30, 314, 1345, PARIS_TOKEN_ID]}},
    {"name": "allowed_token_ids_sampled", "prompt": ONCE, "compare": "first_logprobs",
     "params": {"temperature": 1.0, "seed": 8, "max_tokens": 8, "ignore_eos": True, "logprobs": 3,
                "allowed_token_ids": [30, 314, 1345, PARIS_TOKEN_ID]}},
    {"name": "bad_words_one_token", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 24, "bad_words": ["Paris"]}},
    {"name": "bad_words_two_words", "prompt": CHAT_FRANCE, "params": GREEDY | {"max_tokens": 24, "bad_words": ["capital of", "is"]}},
    {"name": "bad_words_story", "prompt": ONCE, "params": GREEDY | {"max_tokens": 32, "bad_words": ["city of", "Haven"]}},
    # values both engines must refuse
    {"name": "refuse_allowed_token_ids_empty", "prompt": ONCE, "params": GREEDY | {"max_tokens": 4, "allowed_token_ids": []}},
    {"name": "refuse_logit_bias_out_of_vocab", "prompt": ONCE, "params": GREEDY | {"max_tokens": 4, "logit_bias": {10**6: 1.0}}},
    {"name": "refuse_logprobs_over_max", "prompt": ONCE, "params": GREEDY | {"max_tokens": 4, "logprobs": 21}},
    {"name": "refuse_top_p_zero", "prompt": ONCE, "params": {"temperature": 1.0, "top_p": 0.0, "max_tokens": 4}},
]
