"""The proposer interfaces: n-gram and suffix now; a draft-model proposer plugs in here."""

from typing import Protocol

import numpy as np


class Proposer(Protocol):
    """Drafts up to k next tokens for one request from its prompt+output token ids."""

    def propose(self, token_ids: np.ndarray) -> np.ndarray:
        """token_ids: [num_tokens] int32 -> draft: [<= k] int32 (empty: no speculation this step)."""
        ...


class RequestProposer(Proposer, Protocol):
    """A proposer that keeps state per request (suffix tries), fed as tokens arrive, so a step costs
    O(new tokens) rather than a pass over the whole request."""

    def start_request(self, request_id, prompt_token_ids: np.ndarray) -> None: ...

    def extend(self, request_id, new_token_ids: np.ndarray) -> None: ...

    def finish_request(self, request_id) -> None: ...

    def propose_request(self, request_id) -> np.ndarray:
        """draft: [<= k] int32 from the tokens given so far (empty: no speculation this step)."""
        ...
