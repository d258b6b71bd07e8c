"""The proposer interface: n-gram now; suffix and draft-model proposers plug in here."""

from typing import Protocol

import numpy as np


class Proposer(Protocol):
    """Drafts up to k next tokens for one request from its prompt+output token ids."""

    def propose(self, token_ids: np.ndarray) -> np.ndarray:
        """token_ids: [num_tokens] int32 -> draft: [<= k] int32 (empty: no speculation this step)."""
        ...
