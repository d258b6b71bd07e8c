"""XLA_FLAGS for a child process with virtual host devices, keeping the flags the suite set (conftest.py)."""

import os


def with_host_devices(count: int) -> str:
    """$XLA_FLAGS plus `count` virtual CPU devices (read when JAX starts its backend)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
