"""The prefix-caching host-cost bench drives the real block manager the way the scheduler does.

It once crashed when the block manager started reading a sampling parameter its stand-in lacked;
this runs it at a tiny shape with caching on and off.
"""

import pytest

from benchmarks.prefix_host_cost import decode_step_times


@pytest.mark.parametrize("enable_caching", [True, False])
def test_decode_step_times_runs_every_step_with_real_requests(enable_caching):
    times = decode_step_times(enable_caching, num_requests=3, prompt_len=20, steps=17, block_size=4)
    assert len(times) == 17
    assert all(t > 0 for t in times)
