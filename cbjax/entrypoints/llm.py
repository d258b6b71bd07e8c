"""LLM: the offline batch API (vLLM's `LLM`), over one LLMEngine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from cbjax.arguments import UNSUPPORTED_LLM_OPTIONS, ArgumentTypeError, check_int, describe, reject_unsupported
from cbjax.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine
from cbjax.engine.request_book import PROMPT_FORMS, Prompt, parse_prompt
from cbjax.lora.request import LoRARequest
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import RequestOutputKind, SamplingParams
from cbjax.tokenizer.tokenizer import Tokenizer

Message = dict[str, str]


def chat_prompt(tokenizer: Tokenizer, conversation: Sequence[Message], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> dict:
    """A conversation rendered with the model's chat template, as a prompt the engine takes; `tools`
    (OpenAI's function definitions) go to the template as transformers passes them."""
    extra = {} if tools is None else {"tools": tools}
    text = tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt, **extra)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode_chat(text)}


class LLM:
    """Load a converted checkpoint, compile every step, then generate for batches of prompts.

    Takes EngineConfig's options by vLLM's names (max_num_seqs, max_model_len,
    block_size, num_kv_blocks, kv_cache_memory_bytes, gpu_memory_utilization,
    enable_chunked_prefill, max_num_batched_tokens, attention_backend, seed, ...).
    """

    def __init__(self, model: str, **options: Any):
        known = set(EngineConfig.__dataclass_fields__)
        reject_unsupported("LLM", ((k, v) for k, v in options.items() if k not in known), UNSUPPORTED_LLM_OPTIONS)
        options = {k: v for k, v in options.items() if k not in UNSUPPORTED_LLM_OPTIONS or k in known}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"LLM() got unsupported options {unknown}; supported: {sorted(known - {'model'})}")
        self.llm_engine = LLMEngine(EngineConfig(model=model, **options))
        self._next_id = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def get_stats(self) -> dict[str, Any]:
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False (and nothing done) while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt with continuous batching; outputs in input order. `priority`
        (vLLM's: one int per prompt, lower first) needs scheduling_policy="priority". `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model; needs enable_lora)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise ArgumentTypeError(f"prompts must be a prompt ({PROMPT_FORMS}) or a list of them; got {describe(prompts)}")
        for index, prompt in enumerate(prompts):  # each prompt's form, before any is queued
            try:
                parse_prompt(prompt)
            except ValueError as error:
                raise type(error)(f"prompt {index}: {error}") from error
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if not isinstance(sampling_params, Sequence) or not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise ArgumentTypeError(
                f"sampling_params must be a SamplingParams or a list of them, got {describe(sampling_params)}"
            )
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                "pass one SamplingParams or one per prompt"
            )
        priority = [0] * len(prompts) if priority is None else priority
        if not isinstance(priority, Sequence) or len(priority) != len(prompts):
            raise ArgumentTypeError(
                f"priority must be a list of one int per prompt ({len(prompts)}), got {describe(priority)}"
            )
        for index, value in enumerate(priority):
            check_int(f"priority[{index}]", value)
        lora_requests = [lora_request] * len(prompts) if not isinstance(lora_request, Sequence) else lora_request
        if len(lora_requests) != len(prompts):
            raise ValueError(f"got {len(lora_requests)} lora_request for {len(prompts)} prompts; pass one or one per prompt")
        engine = self.llm_engine
        # Only the finished outputs are returned: as vLLM's LLM does, ask the engine for nothing else.
        final_only = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in sampling_params}
        ids = []
        try:
            for prompt, params, request_priority, request_lora in zip(prompts, sampling_params, priority, lora_requests):
                ids.append(str(self._next_id))
                self._next_id += 1
                engine.add_request(ids[-1], prompt, final_only[id(params)], priority=request_priority,
                                   lora_request=request_lora)
        except ValueError as error:
            # One bad prompt rejects the call (as in vLLM); the ones already queued are withdrawn, nothing leaks.
            self._withdraw(ids[:-1])
            raise type(error)(f"prompt {len(ids) - 1} of {len(prompts)}: {error}; no prompt of this call was run") from error
        return self._run(ids, use_tqdm)

    def _withdraw(self, ids: list[str]) -> None:
        """Abort these requests and step until the engine has let go of them (and of every block)."""
        engine = self.llm_engine
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        engine.take_failed()  # (any of them that failed meanwhile is withdrawn all the same)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        priority: Sequence[int] | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate (`priority`: one
        per conversation; `tools`: function definitions the template shows the model, as vLLM's;
        `lora_request`: as generate's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [chat_prompt(self.get_tokenizer(), c, add_generation_prompt, tools) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, priority, lora_request)

    def beam_search(self, prompts: Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's beam search: the best params.beam_width sequences per prompt (see cbjax.entrypoints.beam_search)."""
        return beam_search(self, prompts, params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        start, num_output_tokens = time.perf_counter(), 0
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        num_output_tokens += sum(len(completion.token_ids) for completion in output.outputs)
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{num_output_tokens / (time.perf_counter() - start):.1f}")
                failed = [(request_id, error) for request_id, error in engine.take_failed() if request_id in wanted]
                if failed:  # a prompt the engine could not prepare fails the call, as a bad one does when added
                    self._withdraw([request_id for request_id in ids if request_id not in finished])
                    request_id, error = failed[0]
                    raise ValueError(f"prompt {ids.index(request_id)} of {len(ids)}: {error}; "
                                     "the call's other prompts were withdrawn") from error
        return [finished[request_id] for request_id in ids]
