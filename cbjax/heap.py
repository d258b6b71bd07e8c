"""Handing freed heap back to the OS, so memory that start-up used and freed stops counting in RSS."""

from __future__ import annotations

import ctypes


def release_free_heap() -> None:
    """Return the free memory of every malloc arena to the OS (glibc keeps it otherwise).

    Restoring a checkpoint leaves its host copies and tensorstore's buffers freed but resident
    (about 150 MB for SmolLM2's 540 MB of weights); compiling the steps cold leaves about 470 MB
    in the compiling threads' arenas. Either would count in the engine's footprint.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to release this way
        pass
