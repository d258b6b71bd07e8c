"""The KV pool's size: explicit options, and the CPU default that follows the model (hand-worked cases)."""

from __future__ import annotations

import logging
import warnings

import jax
import pytest

from cbjax.core.kv import sizing as kv_sizing
from cbjax.core.kv.sizing import plan_num_blocks

# SmolLM2-135M with a float32 pool: 30 layers x (K and V) x 3 KV heads x 16 tokens x 64 dims x 4 bytes.
SMOLLM2_BLOCK_BYTES = 30 * 2 * 3 * 16 * 64 * 4  # 737,280
SMOLLM2_WEIGHTS_BYTES = 134_515_008 * 4  # float32


def sizing(**overrides):
    options = dict(bytes_per_block=1024, block_size=16, max_model_len=256, max_num_seqs=4, num_kv_blocks=None,
                   kv_cache_memory_bytes=None, gpu_memory_utilization=None, device=jax.devices("cpu")[0],
                   weights_bytes=10 << 20)
    return plan_num_blocks(**(options | overrides))


def test_explicit_blocks_or_bytes_override_the_default():
    assert sizing(num_kv_blocks=40) == 40
    assert sizing(kv_cache_memory_bytes=50 * 1024 + 100) == 50


def test_small_model_gets_a_pool_of_half_its_weights():
    # 0.5 x 538,060,032 bytes = 269,030,016 // 737,280 = 364 blocks (~5.8k tokens, 256 MiB), not 2 GiB.
    blocks = sizing(bytes_per_block=SMOLLM2_BLOCK_BYTES, weights_bytes=SMOLLM2_WEIGHTS_BYTES, max_model_len=2048,
                    max_num_seqs=64)
    assert blocks == 364


def test_large_model_pool_is_capped_at_two_gib():
    # 16 GB of weights: half would be 8 GB; the cap is 2 GiB = 2,147,483,648 // 1,048,576 = 2048 blocks.
    assert sizing(bytes_per_block=1 << 20, weights_bytes=16_000_000_000, max_num_seqs=1024) == 2048


def test_pool_never_exceeds_what_max_num_seqs_full_length_requests_use():
    # 4 requests x 256 tokens / 16 = 64 blocks, plus the null block.
    assert sizing(weights_bytes=1 << 30) == 4 * 256 // 16 + 1


def test_tiny_model_still_gets_one_max_model_len_request():
    # Half of 1 KiB of weights is no block at all; one 256-token request needs 16 blocks + the null block.
    assert sizing(weights_bytes=1024) == 256 // 16 + 1


def test_pool_too_small_for_one_request_names_the_largest_max_model_len_that_fits():
    with pytest.raises(ValueError, match="lower max_model_len to at most 144"):
        sizing(num_kv_blocks=10)


def test_start_up_line_says_blocks_tokens_bytes_why_and_concurrency(caplog):
    with caplog.at_level(logging.INFO, logger="cbjax.core.kv.sizing"):
        sizing(bytes_per_block=1 << 20, weights_bytes=1000 << 20, max_model_len=2048, max_num_seqs=64)
    # 500 MiB / 1 MiB = 500 blocks = 499 x 16 = 7984 tokens after the null block: 3 requests of
    # 2048 tokens (128 blocks each), 15 of 512.
    (line,) = [r.getMessage() for r in caplog.records if "KV pool" in r.getMessage()]
    assert "500 blocks x 16 tokens = 7984 tokens, 500.0 MiB" in line
    assert "0.5 x the weights' 1000 MiB" in line
    assert "holds 3 requests of max_model_len=2048 at once, or about 15 of 512 tokens" in line


def test_gpu_memory_utilization_on_a_cpu_warns_once(monkeypatch):
    monkeypatch.setattr(kv_sizing, "_warned_cpu_utilization", False)
    with pytest.warns(UserWarning, match="gpu_memory_utilization is ignored on a CPU"):
        sizing(gpu_memory_utilization=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sizing(gpu_memory_utilization=0.5)
        sizing()


def test_gpu_memory_utilization_on_a_cpu_warns_beside_an_explicit_pool_too(monkeypatch):
    monkeypatch.setattr(kv_sizing, "_warned_cpu_utilization", False)
    with pytest.warns(UserWarning, match="gpu_memory_utilization is ignored on a CPU"):
        assert sizing(gpu_memory_utilization=0.5, num_kv_blocks=40) == 40
