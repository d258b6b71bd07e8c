"""Bucket sizes of the precompiled steps: one small pure function, printed at start-up."""

from __future__ import annotations

import dataclasses

# The fewest rows a compiled step has. XLA:CPU runs a one-row bf16 x bf16 -> f32 dot several
# times slower than a two-row one (SmolLM2 decode step, bf16 weights: 156 ms at 1 request,
# 22 ms at 2), so a lone request runs in a two-row step with one padding row.
MIN_ROWS = 2

# The fewest requests of a decode bucket. On an accelerator a decode step streams the weights once whatever
# its rows, so a step of 1-8 requests costs what an 8-request one does, and its decode buckets start at 8
# (fewer compiles at start-up). With the C++ CPU kernels the matmuls' multiply-adds grow with the rows, padded
# or not (most of all for 4-bit and int8 weights, widened in registers per row pass), so a CPU engine's
# decode buckets start at MIN_ROWS: 2, 4, 8, ... (`python -m benchmarks.decode_buckets`).
ACCELERATOR_MIN_DECODE_REQS = 8
CPU_MIN_DECODE_REQS = MIN_ROWS

# With prompt_bucket_midpoints, mixed buckets also come at 1.5x each power of two from this many
# tokens up (96, 192, 384, ...).
# There a step's time grows with its rows, padded or real alike (`python -m benchmarks.step_compile_times
# --calls N`), and the typical prompt step (a prompt of 64-192 tokens beside the running decodes)
# landed just above a power of two: a median of 173 tokens in a 256-token bucket
# (docs/benchmarks-history, section 9). With the midpoints a step pads at most a third of its rows instead of
# a half, for one more compile per octave (3 at the default 512 tokens). Off by default for LLM():
# those 3 compiles and warm-up runs make LLM() start slower (`python -m benchmarks.ab --benchmark startup`),
# which costs more than it saves for offline batches, whose prompt steps fill their
# buckets anyway. On by default for `cbjax serve`: a server starts once and answers prompts beside
# running decodes (its median TTFT at 1 req/s falls: `scripts/bench_serve_side_by_side.sh`, BENCHMARKS.md).
MIDPOINTS_FROM = 64


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """Static shape of one compiled step: `num_tokens` token rows, `num_reqs` request rows."""

    kind: str  # "decode" (one token per request) or "mixed" (ragged prefill chunks + decodes)
    num_tokens: int
    num_reqs: int


def powers_of_two(start: int, limit: int) -> list[int]:
    """start, 2*start, ... below limit, then limit itself (so the largest batch always fits)."""
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


def mixed_token_sizes(start: int, limit: int) -> list[int]:
    """powers_of_two(start, limit) and, from MIDPOINTS_FROM up, the midpoint of each doubling in it
    (a last step to a limit that is not a doubling gets none: it is already a finer step)."""
    sizes = powers_of_two(start, limit)
    midpoints = [low * 3 // 2 for low, high in zip(sizes, sizes[1:]) if low >= MIDPOINTS_FROM and high == 2 * low]
    return sorted(sizes + midpoints)


def compute_buckets(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    *,
    min_decode_reqs: int = ACCELERATOR_MIN_DECODE_REQS,
    min_mixed_tokens: int = 16,
    midpoints: bool = False,
    verify_rows: int = 0,
    num_speculative_tokens: int = 0,
) -> list[Bucket]:
    """All step shapes compiled at start-up.

    Decode steps are bucketed by request count, from `min_decode_reqs` (ACCELERATOR_MIN_DECODE_REQS or
    CPU_MIN_DECODE_REQS) up. Mixed steps are bucketed by token
    count, each with the most requests it can hold (never more requests than
    tokens): a mixed step's padded request rows are nearly free (one-token requests
    run through the decode path, which skips empty rows' work: a 256-token prompt
    alone ran 164 ms in an 8-row and 166 ms in a 32-row bucket), while every bucket
    costs several seconds of compiling at start-up. Token counts are powers of two, with
    `midpoints`, also the midpoints from MIDPOINTS_FROM up. No bucket has fewer than MIN_ROWS rows.
    With speculative decoding (`verify_rows` requests verifying `num_speculative_tokens` drafts each),
    also the mixed buckets such steps fill: n requests of 1 + k tokens (verify_buckets).
    """
    first_reqs = max(MIN_ROWS, min(min_decode_reqs, max_num_seqs))
    req_sizes = powers_of_two(first_reqs, max(max_num_seqs, first_reqs))
    decode = [Bucket("decode", n, n) for n in req_sizes]
    first_tokens = max(MIN_ROWS, min(min_mixed_tokens, max_num_batched_tokens))
    mixed = []
    token_sizes = mixed_token_sizes if midpoints else powers_of_two
    for num_tokens in token_sizes(first_tokens, max(max_num_batched_tokens, first_tokens)):
        feasible = [r for r in req_sizes if r <= num_tokens] or [max(MIN_ROWS, min(num_tokens, max_num_seqs))]
        mixed.append(Bucket("mixed", num_tokens, feasible[-1]))
    # (one no smaller than the largest mixed step would never be picked: the token budget caps a step)
    verifying = [b for b in verify_buckets(verify_rows, num_speculative_tokens) if b.num_tokens < mixed[-1].num_tokens]
    return decode + sorted(mixed + verifying, key=lambda b: (b.num_tokens, b.num_reqs))


def verify_buckets(verify_rows: int, num_speculative_tokens: int) -> list[Bucket]:
    """Mixed buckets of n requests of 1 + k tokens (n = 1, 2, 4, ... verify_rows; MIN_ROWS request rows
    at least): a step verifying a few requests' drafts fills one (1 request, k=4: 5 tokens) instead of
    padding to the smallest prompt bucket (16 tokens, 16 request rows). On CPU a step's time grows with
    its token rows, padded or not: that bucket's verification cost 2.3x a decode step, this one's 1.2x."""
    if verify_rows < 1:
        return []
    k1 = 1 + num_speculative_tokens
    return [Bucket("mixed", n * k1, max(n, MIN_ROWS)) for n in powers_of_two(1, verify_rows)]


def step_shapes(buckets: list[Bucket], decode_runs_as_mixed: bool) -> dict[Bucket, Bucket]:
    """Each bucket's executable, named by the first bucket (in list order) that compiles it.

    With an attention that runs a decode-only step exactly as a mixed one (the C++ CPU kernel),
    a decode bucket and a mixed bucket of the same (tokens, requests) lower to the same program:
    it is compiled, loaded from the cache and warmed up once (the default 64-sequence, 512-token
    set has 3 such pairs among its 12 CPU buckets).
    """
    first: dict[object, Bucket] = {}
    return {
        bucket: first.setdefault((bucket.num_tokens, bucket.num_reqs) if decode_runs_as_mixed else bucket, bucket)
        for bucket in buckets
    }


def pick_bucket(buckets: list[Bucket], kind: str, num_tokens: int, num_reqs: int) -> Bucket:
    """The smallest bucket of `kind` that holds the step."""
    fitting = [b for b in buckets if b.kind == kind and b.num_tokens >= num_tokens and b.num_reqs >= num_reqs]
    if not fitting:
        raise ValueError(
            f"no {kind} bucket holds {num_tokens} tokens / {num_reqs} requests; "
            f"largest is {max((b for b in buckets if b.kind == kind), default=None)}"
        )
    return min(fitting, key=lambda b: (b.num_tokens, b.num_reqs))


def one_request_buckets(buckets: list[Bucket], num_prompt_tokens: int, max_num_batched_tokens: int) -> list[Bucket]:
    """The buckets one request alone runs in: its prompt in chunks of at most max_num_batched_tokens
    (the scheduler's chunked prefill), then one-token decodes."""
    chunks = {min(max_num_batched_tokens, num_prompt_tokens - start) for start in range(0, num_prompt_tokens, max_num_batched_tokens)}
    needed = {pick_bucket(buckets, "decode" if n == 1 else "mixed", n, 1) for n in chunks | {1}}
    return sorted(needed, key=buckets.index)
