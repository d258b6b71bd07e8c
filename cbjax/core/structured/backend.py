"""The interface a structured-output backend implements (vLLM's StructuredOutputBackend / Grammar split)."""

from abc import ABC, abstractmethod

import numpy as np
from jaxtyping import Int32

from cbjax.sampling_params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a packed mask: bit j of word w allows token 32 * w + j."""
    return (vocab_size + 31) // 32


class Grammar(ABC):
    """One completion's position in its constraint, advanced with each accepted token."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over sampled tokens; False if one of them is not allowed (the grammar is then broken)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Int32[np.ndarray, "rows words"], row: int) -> None:
        """Write the tokens allowed next into bitmask[row]."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and allows nothing but stopping."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start, for a preempted request recomputed from its prompt."""

    @abstractmethod
    def fork(self) -> "Grammar":
        """An independent copy at the same position (a beam that grows two ways)."""

    def allowed_token_ids(self, vocab_size: int) -> set[int]:
        """The tokens allowed next, as ids."""
        bitmask = np.zeros((1, bitmask_words(vocab_size)), np.int32)
        self.fill_bitmask(bitmask, 0)
        return set(np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]).tolist())


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer; compile() may be slow and runs off the scheduler's thread."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh Grammar for params; ValueError naming the problem if the constraint does not compile."""
