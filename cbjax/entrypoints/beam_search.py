"""Beam search on top of the engine, the way vLLM's `LLM.beam_search` does it.

Each iteration every live beam is one request that generates a single token with
`logprobs=2 * beam_width` (Hugging Face's 2x candidates); every candidate extends its beam by
its logprob, a candidate ending in EOS is set aside as finished (unless `ignore_eos`), and the
best `beam_width` of the rest live on. At the end finished and live beams are ranked together by
`cum_logprob / len(tokens) ** length_penalty` (the EOS not counted) and the best `beam_width` are
returned. Beams are plain requests, so they share prompt blocks wherever the KV cache shares them.

With `structured_outputs` (vLLM's), each beam carries its own grammar position: its candidates are
the tokens among its 2 * beam_width that the grammar allows (EOS only where the output is complete;
the logprobs are the model's, unmasked, as vLLM's), and a beam whose grammar is complete ends there
("stop"). A beam whose candidates are all disallowed ends, as in vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cbjax.outputs import Logprob, RequestOutput
from cbjax.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from cbjax.core.structured.backend import Grammar
    from cbjax.engine.llm_engine import Prompt
    from cbjax.entrypoints.llm import LLM


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: how wide, how long, and how finished beams are ranked."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the final EOS's text in `text`
    structured_outputs: StructuredOutputsParams | None = None  # every beam's output must match it

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(
                f"beam_width must be in [1, {MAX_LOGPROBS // 2}] (each step asks for 2 * beam_width logprobs, "
                f"at most {MAX_LOGPROBS}), got {self.beam_width}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: prompt plus generated tokens (as in vLLM), a logprobs dict per generated token."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None  # filled for the returned beams: the decoded tokens, prompt included
    finish_reason: str | None = None  # "stop" (ended on EOS) | "length"
    stop_reason: int | str | None = None  # the EOS id that ended it
    grammar: Grammar | None = dataclasses.field(default=None, repr=False)  # its constraint's position


@dataclasses.dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_ids: set[int], length_penalty: float) -> float:
    """vLLM's (and Hugging Face's) ranking: cumulative logprob over length ** length_penalty, EOS not counted."""
    seq_len = len(tokens) - (tokens[-1] in eos_token_ids)
    return cum_logprob / seq_len**length_penalty


@dataclasses.dataclass
class _Search:
    """The beams of one prompt: those still growing and those that ended on EOS."""

    live: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = dataclasses.field(default_factory=list)


def beam_search(llm: LLM, prompts: Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.llm_engine
    eos = set(engine.eos_token_ids)
    max_logprobs, max_model_len = engine.config.max_logprobs, engine.config.max_model_len
    if 2 * params.beam_width > max_logprobs:
        raise ValueError(
            f"beam_width={params.beam_width} needs {2 * params.beam_width} logprobs per step; "
            f"max_logprobs is {max_logprobs}; lower beam_width or raise max_logprobs"
        )
    step_params = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width)

    def rank(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    start = None if params.structured_outputs is None else _start_grammar(engine, params.structured_outputs)
    # The first step runs on the prompts as given, so the engine tokenizes them as generate() would.
    results = llm.generate(list(prompts), step_params, use_tqdm=False)
    searches = []
    for index, result in enumerate(results):
        num_prompt_tokens = len(result.prompt_token_ids)
        if num_prompt_tokens + params.max_tokens > max_model_len:
            raise ValueError(
                f"prompt {index} has {num_prompt_tokens} tokens and max_tokens={params.max_tokens}, "
                f"{num_prompt_tokens + params.max_tokens} in all; max_model_len is {max_model_len}; "
                "lower max_tokens, shorten the prompt or raise max_model_len"
            )
        grammar = None if start is None else start.fork()
        searches.append(_Search([BeamSearchSequence(list(result.prompt_token_ids), [], grammar=grammar)]))
    for step in range(params.max_tokens):
        if step > 0:
            beams = [{"prompt_token_ids": beam.tokens} for search in searches for beam in search.live]
            if not beams:
                break
            results = llm.generate(beams, step_params, use_tqdm=False)
        remaining = iter(results)
        for search in searches:
            _expand(search, [next(remaining) for _ in search.live], eos, params, rank, engine.model_config.vocab_size)
    tokenizer = llm.get_tokenizer()
    outputs = []
    for search in searches:
        best = sorted(search.finished + search.live, key=rank, reverse=True)[: params.beam_width]
        for beam in best:
            ended_on_eos = beam.stop_reason is not None  # (a complete grammar stops it without one)
            shown = beam.tokens[:-1] if ended_on_eos and not params.include_stop_str_in_output else beam.tokens
            beam.text = tokenizer.decode(shown, skip_special_tokens=False)
            beam.finish_reason = beam.finish_reason or "length"
        outputs.append(BeamSearchOutput(best))
    return outputs


def _start_grammar(engine, constraint: StructuredOutputsParams) -> Grammar:
    """The constraint compiled for the engine's tokenizer and logits width (ValueError if it does not compile)."""
    from tokenizers import Tokenizer

    from cbjax.core.structured.guidance import GuidanceBackend

    tokenizer = Tokenizer.from_file(str(Path(engine.config.tokenizer or engine.config.model) / "tokenizer.json"))
    return GuidanceBackend(tokenizer, engine.model_config.vocab_size, engine.eos_token_ids).compile(constraint)


def _finish_complete(search: _Search) -> None:
    """Set aside the live beams whose constraint is complete: they end with "stop", as constrained requests do."""
    complete = [beam for beam in search.live if beam.grammar is not None and beam.grammar.is_terminated()]
    for beam in complete:
        beam.finish_reason = "stop"
    search.finished += complete
    search.live = [beam for beam in search.live if beam not in complete]


def _expand(
    search: _Search,
    results: list[RequestOutput],
    eos: set[int],
    params: BeamSearchParams,
    rank: Callable[[BeamSearchSequence], float],
    vocab_size: int,
) -> None:
    """Grow every live beam by each of its candidates (those its grammar allows, if constrained); keep the
    best beam_width, set EOS endings aside."""
    candidates = []
    for beam, result in zip(search.live, results):
        entry = result.outputs[0].logprobs[0]
        allowed = None if beam.grammar is None else beam.grammar.allowed_token_ids(vocab_size)
        for token_id, logprob in entry.items():
            if allowed is not None and token_id not in allowed:
                continue
            grown = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [entry], beam.cum_logprob + logprob.logprob)
            if beam.grammar is not None:
                grown.grammar = beam.grammar.fork()
                grown.grammar.accept_tokens([token_id])
            if token_id in eos and not params.ignore_eos:
                grown.finish_reason, grown.stop_reason = "stop", token_id
                search.finished.append(grown)
            else:
                candidates.append(grown)
    search.live = sorted(candidates, key=rank, reverse=True)[: params.beam_width]
    _finish_complete(search)
