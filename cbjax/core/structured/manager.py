"""The engine core's grammars (vLLM's StructuredOutputManager): compiled off the engine loop, one per
completion, and advanced over each request's sampled tokens.

A constrained request's completions wait here, not in the scheduler, while their grammars compile
(vLLM's WAITING_FOR_FSM), so nobody queued behind them waits too. The runner reads `request.grammar`
to fill each constrained row's mask; the core calls `advance` after each step it reads.
With a reasoning parser, each grammar applies only after the reply's thinking (reasoning.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from cbjax.core.request import Request
from cbjax.core.structured.reasoning import AfterReasoning, reasoning_ended

if TYPE_CHECKING:  # the backend (llguidance, numpy) is imported by the first compile, not by `import cbjax`
    from cbjax.core.structured.backend import Grammar, StructuredOutputBackend

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, tokenizer_dir: str, vocab_size: int, reasoning_parser: str | None = None):
        self._tokenizer_dir = Path(tokenizer_dir)
        self._vocab_size = vocab_size  # the model's logits width: the mask's
        self._reasoning_parser = reasoning_parser
        self._tokenizer: Tokenizer | None = None
        self._backend: StructuredOutputBackend | None = None  # made by the first compile (reads the vocabulary)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        # Each constrained prompt's completions, with their grammars' compile (one grammar per completion).
        self._compiling: dict[concurrent.futures.Future, Sequence[Request]] = {}
        # Unfinished requests with a grammar -> how many of their output tokens it has accepted.
        self._accepted: dict[Request, int] = {}

    def submit(self, completions: Sequence[Request]) -> None:
        """Compile a grammar for each completion of one constrained prompt, off the caller's thread."""
        self._compiling[self._executor.submit(self._compile, completions)] = completions

    def _compile(self, completions: Sequence[Request]) -> list[Grammar]:
        if self._backend is None:
            from cbjax.core.structured.guidance import GuidanceBackend

            self._tokenizer = Tokenizer.from_file(str(self._tokenizer_dir / "tokenizer.json"))
            self._backend = GuidanceBackend(self._tokenizer, self._vocab_size, completions[0].eos_token_ids)
        params = completions[0].sampling_params.structured_outputs
        grammars = [self._backend.compile(params) for _ in completions]
        if self._reasoning_parser is None:
            return grammars
        ended = reasoning_ended(self._tokenizer.decode(completions[0].prompt_token_ids, skip_special_tokens=False))
        return [AfterReasoning(grammar, self._decode_token, ended) for grammar in grammars]

    def _decode_token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)  # the markers may be special tokens

    def take_compiled(self) -> tuple[list[Sequence[Request]], list[tuple[Request, str]]]:
        """The prompts whose grammars are ready (each completion's set as `request.grammar`; those
        aborted meanwhile left out), and (request, why) for each whose compile failed."""
        ready, failed = [], []
        for future in [f for f in self._compiling if f.done()]:
            completions = [r for r in self._compiling.pop(future) if not r.is_finished]
            try:
                grammars = future.result()
            except ValueError as error:  # the check when it arrived passed, so this is rare: fail it alone
                failed += [(request, str(error)) for request in completions]
                continue
            for request, grammar in zip(completions, grammars):
                request.grammar = grammar
                self._accepted[request] = request.num_output_tokens
            if completions:
                ready.append(completions)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until some compile finishes, or timeout seconds (the loop has nothing else to do)."""
        concurrent.futures.wait(self._compiling, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def withdraw(self, request_id: str) -> Request | None:
        """The unfinished request of that id still compiling (the caller finishes it), else None."""
        for completions in self._compiling.values():
            for request in completions:
                if request.request_id == request_id and not request.is_finished:
                    return request
        return None

    def is_compiling(self) -> bool:
        """Whether some compile has not been taken yet (its requests may all be aborted already)."""
        return bool(self._compiling)  # (asked every step: a dict's truth, no scan)

    def has_constrained(self) -> bool:
        """Whether some request has a grammar and was unfinished at the last `advance` (which drops
        the finished ones): async scheduling waits for a constrained row's tokens."""
        return bool(self._accepted)

    def advance(self) -> list[Request]:
        """Feed each constrained request's new output tokens to its grammar; the unfinished requests
        whose grammar is now complete (the core finishes them with "stop")."""
        complete = []
        for request, num_accepted in list(self._accepted.items()):
            if request.is_finished:
                del self._accepted[request]
                continue
            new_tokens = request.output_token_ids[num_accepted:]
            if not new_tokens:
                continue
            self._accepted[request] = request.num_output_tokens
            if not request.grammar.accept_tokens(new_tokens):  # the mask allows only what it accepts
                logger.error("request %s sampled tokens %s its grammar rejects; it stops here",
                             request.request_id, new_tokens)
                complete.append(request)
            elif request.grammar.is_terminated():
                complete.append(request)
        return complete
