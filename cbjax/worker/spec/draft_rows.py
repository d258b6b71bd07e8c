"""A step's draft rows on the host: written from the schedule's drafts, read back as each row's run."""

from __future__ import annotations

from collections.abc import Sequence

from cbjax.worker.sample.verify import DraftInputs, VerifiedTokens


def draft_rows_needed(config) -> int:
    """Draft rows of a step (0: speculation off): a step speculates only with at most
    disable_by_batch_size running, and each speculating row counts as one of its max_num_prefills."""
    spec = config.speculative_config
    return 0 if spec is None else min(spec.disable_by_batch_size, config.max_num_seqs, config.max_num_prefills)


def write_draft_row(drafts: DraftInputs, index: int, sampling_row: int, first_token_row: int,
                    token_ids: Sequence[int]) -> None:
    """Draft row `index`: the sampling row it verifies, where its newest token sits among the step's
    token rows (its drafts follow it there) and the drafts."""
    num_draft = len(token_ids)
    drafts.sampling_rows[index] = sampling_row
    drafts.logits_indices[index] = first_token_row + num_draft  # padding positions repeat the last
    drafts.logits_indices[index, : num_draft + 1] = range(first_token_row, first_token_row + num_draft + 1)
    drafts.token_ids[index, :num_draft] = token_ids
    drafts.num_draft[index] = num_draft


def runs(drafts: DraftInputs, verified: VerifiedTokens, num_rows: int) -> dict[int, list[int]]:
    """By sampling row, the tokens each of the first `num_rows` draft rows emitted: its accepted drafts,
    then the token sampled after them."""
    accepted = verified.num_accepted[:num_rows].tolist()
    tokens = verified.token_ids[:num_rows].tolist()
    return {row: tokens[i][: accepted[i] + 1] for i, row in enumerate(drafts.sampling_rows[:num_rows].tolist())}
