"""release_free_heap hands freed malloc memory back to the OS (what keeps the cold start's peak RSS down)."""

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import threading
    from cbjax.heap import release_free_heap

    def rss_mib():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

    def allocate_and_free():  # in a thread, as XLA compiles: its own malloc arena
        chunks = [bytearray(100_000) for _ in range(3000)]  # below the mmap threshold: arena memory
        del chunks[:-1]  # the last chunk pins the arena's top, so free() alone cannot shrink it
        global pinned
        pinned = chunks

    thread = threading.Thread(target=allocate_and_free)
    thread.start()
    thread.join()
    before = rss_mib()
    release_free_heap()
    print(before, rss_mib())
""")


def test_release_free_heap_returns_a_threads_freed_arena_memory():
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True)
    before, after = map(float, result.stdout.split())
    # 300 MB were allocated and freed; glibc kept them resident until the trim.
    assert before - after > 200, (before, after)


def test_freeze_gc_heap_takes_what_is_alive_out_of_later_collections():
    """What `cbjax serve` and `cbjax worker` do once ready: objects alive then are never scanned again
    by the cyclic collector (its full collections paused a 256-request loop ~80 ms, docs/benchmarks-history,
    section 10), while objects made later still are."""
    import gc

    from cbjax.heap import freeze_gc_heap

    before = [[i] for i in range(1000)]  # containers: tracked by the collector
    assert any(obj is before for obj in gc.get_objects())
    try:
        frozen = freeze_gc_heap()
        after = [[i] for i in range(10)]
        # (a frozen object another thread frees meanwhile leaves the permanent generation: never more)
        assert frozen >= gc.get_freeze_count() >= 1000
        tracked = gc.get_objects()
        assert not any(obj is before for obj in tracked)
        assert any(obj is after for obj in tracked)
        # A cycle made after the freeze is still collected.
        cycle = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
