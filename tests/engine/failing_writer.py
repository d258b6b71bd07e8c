"""A sampling-column writer that raises for one marked kind of request (issue 35: a request the
runner cannot prepare fails alone), patched in this process or, through ProcessCoreClient.call,
in an engine core's process."""

from __future__ import annotations

from cbjax.sampling_params import SamplingParams
from cbjax.worker import model_runner
from cbjax.worker.sample import sampler

MARKED_TOP_P = 0.875  # the mark: a top_p no other test uses
MARKED = SamplingParams(temperature=1.0, top_p=MARKED_TOP_P, max_tokens=6, n=2)
# Of its 3 completions (seeds 700, 701, 702: seed + index) only the second fails; the others could run long.
FAILING_SEED = 701
ONE_OF_THREE_FAILS = SamplingParams(temperature=1.0, top_p=MARKED_TOP_P, seed=FAILING_SEED - 1, n=3,
                                    max_tokens=100, ignore_eos=True)
_WRITER = sampler.request_columns


def fails_if_marked(params: SamplingParams, seed: int, penalty_slot: int = sampler.NO_SLOT) -> sampler.RequestColumns:
    if params.top_p == MARKED_TOP_P and params.seed in (None, FAILING_SEED):
        raise OverflowError("Python int too large to convert to C long")
    return _WRITER(params, seed, penalty_slot)


def patch_writers(patch, failing: bool = True) -> None:
    """`patch(module, name, value)` the runner's column writer: failing MARKED requests, or as it was."""
    for module in (sampler, model_runner):
        patch(module, "request_columns", fails_if_marked if failing else _WRITER)


def patch_core_writers(core, failing: bool) -> None:
    """patch_writers in an engine core's process (a ProcessCoreClient.call probe)."""
    patch_writers(setattr, failing)


def core_num_steps(core) -> int:
    """The steps an engine core has run (a ProcessCoreClient.call probe)."""
    return core.get_stats()["num_steps"]
